package org.mtpedge.demo

import android.app.Activity
import android.app.AlertDialog
import android.os.Bundle
import android.os.SystemClock
import android.view.Gravity
import android.view.View
import android.widget.AdapterView
import android.widget.ArrayAdapter
import android.widget.Button
import android.widget.EditText
import android.widget.LinearLayout
import android.widget.ScrollView
import android.widget.Spinner
import android.widget.Switch
import android.widget.TextView
import java.io.File
import java.util.concurrent.Executors
import org.json.JSONObject

/**
 * The chat screen: pick a bundle, talk with it over several turns, stop an answer, change the
 * settings (drafter on/off, k, temperature, answer length) and watch tokens/s and acceptance.
 *
 * The conversation lives in the core (Chat): each answer prefills only the new message, the
 * earlier turns stay in the model's cache.
 */
class MainActivity : Activity() {
    // The core forbids overlapping calls on one engine: every engine call runs on this thread.
    private val worker = Executors.newSingleThreadExecutor()
    @Volatile private var engine: Engine? = null
    @Volatile private var chat: Chat? = null
    @Volatile private var stopRequested = false
    private var generating = false
    private var settings = Settings()
    private var bundleDir: File? = null
    private var pieces = 0 // of the answer being generated, for the live rate
    private var firstPieceAt = 0L

    private lateinit var statsView: TextView
    private lateinit var messages: LinearLayout
    private lateinit var scrollView: ScrollView
    private lateinit var input: EditText
    private lateinit var sendButton: Button

    override fun onCreate(savedInstanceState: Bundle?) {
        super.onCreate(savedInstanceState)
        setContentView(R.layout.activity_main)
        statsView = find(R.id.stats)
        messages = find(R.id.messages)
        scrollView = find(R.id.scroll)
        input = find(R.id.input)
        sendButton = find(R.id.send)
        sendButton.setOnClickListener { if (generating) stopRequested = true else send() }
        find<Button>(R.id.settings).setOnClickListener { showSettings() }
        find<Button>(R.id.new_chat).setOnClickListener { newChat() }
        val saved = getSharedPreferences(PREFERENCES, MODE_PRIVATE)
        settings = settings.copy(remember = saved.getBoolean(REMEMBER, false))

        val bundles = findBundles(this)
        if (bundles.isEmpty()) {
            val places = bundleRoots(this).joinToString("\n") { it.path }
            statsView.text = getString(R.string.no_bundles, places)
            sendButton.isEnabled = false
            return
        }
        val spinner = find<Spinner>(R.id.bundle)
        spinner.adapter = ArrayAdapter(
            this, android.R.layout.simple_spinner_dropdown_item, bundles.map { it.path },
        )
        spinner.onItemSelectedListener = object : AdapterView.OnItemSelectedListener {
            override fun onItemSelected(parent: AdapterView<*>?, view: View?, pos: Int, id: Long) =
                openBundle(bundles[pos])

            override fun onNothingSelected(parent: AdapterView<*>?) = Unit
        }
    }

    /** Where the requests to a bundle are logged when the user asked to remember them. */
    private fun requestLogDir(bundle: File) = File(File(filesDir, "request-logs"), bundle.name)

    /**
     * Remembering on: the engine logs each answered request in the app's storage, and its
     * store starts from what earlier sessions logged. Off: logging stops and the log is deleted.
     * Runs on the worker thread; a message for the stats line when something went wrong.
     */
    private fun applyRemember(opened: Engine, bundle: File, remember: Boolean): String? {
        val dir = requestLogDir(bundle)
        return try {
            if (remember) {
                opened.keepRequestLog(dir)
            } else {
                opened.keepRequestLog(null)
                dir.deleteRecursively()
            }
            null
        } catch (e: RuntimeException) {
            getString(R.string.log_failed, e.message)
        }
    }

    private fun openBundle(dir: File) {
        bundleDir = dir
        sendButton.isEnabled = false
        messages.removeAllViews()
        statsView.text = getString(R.string.loading, dir.name)
        val remember = settings.remember
        worker.execute {
            closeEngine()
            val started = SystemClock.elapsedRealtime()
            val message = try {
                val opened = Engine.open(dir)
                engine = opened
                chat = Chat(opened)
                val took = SystemClock.elapsedRealtime() - started
                val problem = if (remember) applyRemember(opened, dir, true) else null
                problem ?: getString(R.string.loaded, dir.name, took)
            } catch (e: RuntimeException) {
                closeEngine()
                getString(R.string.load_failed, e.message)
            } catch (e: LinkageError) { // an APK built without the NDK: no libmtp_demo_jni.so
                getString(R.string.no_native_library, (e.cause ?: e).toString())
            }
            runOnUiThread {
                statsView.text = message
                sendButton.isEnabled = chat != null
            }
        }
    }

    private fun closeEngine() {
        chat?.close()
        chat = null
        engine?.close()
        engine = null
    }

    private fun newChat() {
        stopRequested = true
        messages.removeAllViews()
        statsView.text = getString(R.string.new_conversation)
        worker.execute { chat?.reset() }
    }

    private fun send() {
        val text = input.text.toString().trim()
        val current = chat ?: return
        if (text.isEmpty()) return
        input.text.clear()
        addMessage(getString(R.string.you), text, user = true)
        val reply = addMessage(getString(R.string.assistant), "", user = false)
        setGenerating(true)
        val chosen = settings
        worker.execute {
            val outcome = try {
                if (current.addUser(text)) {
                    formatStats(current.answer(chosen) { piece -> show(reply, piece) }, chosen)
                } else {
                    getString(R.string.context_full)
                }
            } catch (e: RuntimeException) {
                getString(R.string.generate_failed, e.message)
            }
            runOnUiThread {
                statsView.text = outcome
                setGenerating(false)
            }
        }
    }

    /** Shows a piece of the answer (on the worker thread); false once Stop was tapped. */
    private fun show(reply: TextView, piece: String): Boolean {
        val now = SystemClock.elapsedRealtimeNanos()
        if (pieces == 0) firstPieceAt = now
        pieces += 1
        // Live rate: pieces are whole characters of one or more tokens, so this is an
        // estimate until the core's exact stats arrive at the end of the answer.
        val seconds = (now - firstPieceAt) / 1e9
        val live = if (seconds > 0) (pieces - 1) / seconds else 0.0
        runOnUiThread {
            reply.append(piece)
            statsView.text = getString(R.string.live_stats, live)
            scrollView.post { scrollView.fullScroll(View.FOCUS_DOWN) }
        }
        return !stopRequested
    }

    private fun setGenerating(on: Boolean) {
        generating = on
        stopRequested = false
        pieces = 0
        sendButton.setText(if (on) R.string.stop else R.string.send)
    }

    private fun addMessage(who: String, text: String, user: Boolean): TextView {
        val view = TextView(this).apply {
            this.text = text
            hint = who  // shown while an answer has no text yet
            gravity = if (user) Gravity.END else Gravity.START
            setPadding(8, 16, 8, 16)
            setTextIsSelectable(true)
            if (user) setTypeface(typeface, android.graphics.Typeface.BOLD)
        }
        messages.addView(view)
        scrollView.post { scrollView.fullScroll(View.FOCUS_DOWN) }
        return view
    }

    /** The settings sheet; what it sets applies from the next answer on. */
    private fun showSettings() {
        val view = layoutInflater.inflate(R.layout.settings, null)
        val speculative = view.find<Switch>(R.id.setting_speculative)
        val store = view.find<Switch>(R.id.setting_store)
        val k = view.find<EditText>(R.id.setting_k)
        val temperature = view.find<EditText>(R.id.setting_temperature)
        val maxNewTokens = view.find<EditText>(R.id.setting_max_new_tokens)
        speculative.isChecked = settings.speculative
        store.isChecked = settings.store
        val remember = view.find<Switch>(R.id.setting_remember)
        remember.isChecked = settings.remember
        k.setText(settings.k?.toString().orEmpty())
        temperature.setText(settings.temperature.toString())
        maxNewTokens.setText(settings.maxNewTokens.toString())
        AlertDialog.Builder(this)
            .setTitle(R.string.settings)
            .setView(view)
            .setPositiveButton(android.R.string.ok) { _, _ ->
                val rememberChanged = remember.isChecked != settings.remember
                settings = Settings(
                    speculative = speculative.isChecked,
                    k = k.text.toString().toIntOrNull(),
                    temperature = temperature.text.toString().toDoubleOrNull() ?: 0.0,
                    maxNewTokens = maxNewTokens.text.toString().toIntOrNull() ?: 256,
                    store = store.isChecked,
                    remember = remember.isChecked,
                )
                getSharedPreferences(PREFERENCES, MODE_PRIVATE).edit()
                    .putBoolean(REMEMBER, remember.isChecked).apply()
                val chosen = settings.remember
                val bundle = bundleDir
                if (rememberChanged) worker.execute {
                    val opened = engine
                    val problem = if (opened != null && bundle != null) {
                        applyRemember(opened, bundle, chosen)
                    } else {
                        null
                    }
                    if (problem != null) runOnUiThread { statsView.text = problem }
                }
            }
            .setNegativeButton(android.R.string.cancel, null)
            .show()
    }

    /** The core's own numbers for the finished answer (stats as `mtp-run --json`). */
    private fun formatStats(result: JSONObject, chosen: Settings): String {
        val stats = result.getJSONObject("stats")
        val rate = stats.optDouble("decode_tokens_per_s")
        val tokens = stats.optInt("generated_tokens")
        val ttft = stats.optDouble("ttft_ms")
        val prefilled = result.optInt("prefilled_tokens")
        val kept = result.optInt("reused_tokens")
        val stop = result.optString("stop_reason")
        return if (chosen.speculative) {
            getString(
                R.string.spec_stats, rate, stats.optDouble("tau"),
                100 * stats.optDouble("acceptance_rate"), tokens, prefilled, kept, ttft, stop,
                result.optString("drafter"),
            )
        } else {
            getString(R.string.plain_stats, rate, tokens, prefilled, kept, ttft, stop)
        }
    }

    override fun onDestroy() {
        stopRequested = true
        worker.execute { closeEngine() }
        worker.shutdown()
        super.onDestroy()
    }
}

private const val PREFERENCES = "settings"
private const val REMEMBER = "remember_requests"

// findViewById's generic form (<T : View>) is API 26; these read the View and cast it, which
// compiles against every android.jar the app is built with (API 23 here, 35 with Gradle).
private inline fun <reified V : View> Activity.find(id: Int): V {
    val found: View = findViewById(id)
    return found as V
}

private inline fun <reified V : View> View.find(id: Int): V {
    val found: View = findViewById(id)
    return found as V
}
