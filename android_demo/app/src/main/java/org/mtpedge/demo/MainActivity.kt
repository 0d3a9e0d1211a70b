package org.mtpedge.demo

import android.app.Activity
import android.os.Bundle
import android.os.SystemClock
import android.view.View
import android.widget.AdapterView
import android.widget.ArrayAdapter
import android.widget.Button
import android.widget.EditText
import android.widget.ScrollView
import android.widget.Spinner
import android.widget.Switch
import android.widget.TextView
import java.io.File
import java.util.concurrent.Executors
import org.json.JSONObject

/**
 * The chat screen: pick a bundle, type a message, watch the reply stream in with tokens/s, and
 * switch speculative decoding on and off to see the difference on this phone.
 *
 * Each message is one single-turn prompt: the core wraps it in the bundle's chat format.
 */
class MainActivity : Activity() {
    // The core forbids overlapping calls on one engine: every engine call runs on this thread.
    private val worker = Executors.newSingleThreadExecutor()
    @Volatile private var engine: Engine? = null
    private var bundles: List<File> = emptyList()

    private lateinit var bundleSpinner: Spinner
    private lateinit var speculativeSwitch: Switch
    private lateinit var statsView: TextView
    private lateinit var transcriptView: TextView
    private lateinit var scrollView: ScrollView
    private lateinit var input: EditText
    private lateinit var sendButton: Button

    override fun onCreate(savedInstanceState: Bundle?) {
        super.onCreate(savedInstanceState)
        setContentView(R.layout.activity_main)
        bundleSpinner = findViewById(R.id.bundle)
        speculativeSwitch = findViewById(R.id.speculative)
        statsView = findViewById(R.id.stats)
        transcriptView = findViewById(R.id.transcript)
        scrollView = findViewById(R.id.scroll)
        input = findViewById(R.id.input)
        sendButton = findViewById(R.id.send)

        bundles = findBundles(this)
        if (bundles.isEmpty()) {
            val places = bundleRoots(this).joinToString("\n") { it.path }
            statsView.text = getString(R.string.no_bundles, places)
            sendButton.isEnabled = false
            return
        }
        bundleSpinner.adapter = ArrayAdapter(
            this, android.R.layout.simple_spinner_dropdown_item, bundles.map { it.path },
        )
        bundleSpinner.onItemSelectedListener = object : AdapterView.OnItemSelectedListener {
            override fun onItemSelected(parent: AdapterView<*>?, view: View?, pos: Int, id: Long) =
                openBundle(bundles[pos])

            override fun onNothingSelected(parent: AdapterView<*>?) = Unit
        }
        sendButton.setOnClickListener { send() }
    }

    private fun openBundle(dir: File) {
        sendButton.isEnabled = false
        statsView.text = getString(R.string.loading, dir.name)
        worker.execute {
            engine?.close()
            engine = null
            val started = SystemClock.elapsedRealtime()
            val message = try {
                engine = Engine.open(dir)
                getString(R.string.loaded, dir.name, SystemClock.elapsedRealtime() - started)
            } catch (e: RuntimeException) {
                getString(R.string.load_failed, e.message)
            }
            runOnUiThread {
                statsView.text = message
                sendButton.isEnabled = engine != null
            }
        }
    }

    private fun send() {
        val prompt = input.text.toString().trim()
        val current = engine ?: return
        if (prompt.isEmpty()) return
        input.text.clear()
        sendButton.isEnabled = false
        val speculative = speculativeSwitch.isChecked
        transcriptView.append("\n\nYou: $prompt\n\nAssistant: ")
        val options = JSONObject()
            .put("max_new_tokens", 256)
            .put("speculative", speculative)
            .put("temperature", 0.0)
            .put("chat", true)
        worker.execute {
            var pieces = 0
            var firstPieceAt = 0L
            val text = try {
                val result = current.generate(prompt, options) { piece ->
                    val now = SystemClock.elapsedRealtimeNanos()
                    if (pieces == 0) firstPieceAt = now
                    pieces += 1
                    // Live rate: pieces are whole characters of one or more tokens, so this is
                    // an estimate until the core's exact stats arrive at the end of the reply.
                    val seconds = (now - firstPieceAt) / 1e9
                    val live = if (seconds > 0) (pieces - 1) / seconds else 0.0
                    runOnUiThread {
                        transcriptView.append(piece)
                        statsView.text = getString(R.string.live_stats, live)
                        scrollView.post { scrollView.fullScroll(View.FOCUS_DOWN) }
                    }
                }
                formatStats(result, speculative)
            } catch (e: RuntimeException) {
                getString(R.string.generate_failed, e.message)
            }
            runOnUiThread {
                statsView.text = text
                sendButton.isEnabled = true
            }
        }
    }

    /** The core's own numbers for the finished reply (same keys as `mtp-run --json`). */
    private fun formatStats(result: JSONObject, speculative: Boolean): String {
        val stats = result.getJSONObject("stats")
        val rate = stats.optDouble("decode_tokens_per_s")
        val tokens = stats.optInt("generated_tokens")
        val ttft = stats.optDouble("ttft_ms")
        val stop = result.optString("stop_reason")
        return if (speculative) {
            getString(
                R.string.spec_stats, rate, stats.optDouble("tau"),
                100 * stats.optDouble("acceptance_rate"), tokens, ttft, stop,
                result.optString("drafter"),
            )
        } else {
            getString(R.string.plain_stats, rate, tokens, ttft, stop)
        }
    }

    override fun onDestroy() {
        worker.execute { engine?.close() }
        worker.shutdown()
        super.onDestroy()
    }
}
