package org.mtpedge.demo

import android.app.Activity
import android.app.ActivityManager
import android.os.Build
import android.os.Bundle
import android.util.Log
import java.io.File
import org.json.JSONObject

/**
 * Benchmark mode, driven by intent extras the way ExecuTorch's minibench app is:
 *
 *   adb shell am start -W -S -n org.mtpedge.demo/.BenchmarkActivity \
 *     --es bundle_dir /data/local/tmp/mtp/bundle --es prompts /data/local/tmp/mtp/prompts.jsonl \
 *     --ei repeat 3 --ei max_new_tokens 128
 *   adb shell run-as org.mtpedge.demo cat files/benchmark_results.json
 *
 * Every prompt runs plain then speculative (greedy) in the C++ core; the report (minibench-style
 * metrics plus every run's result) is written to files/benchmark_results.json, or
 * {"error": ...} when something fails. Progress goes to logcat (tag mtp-bench).
 */
class BenchmarkActivity : Activity() {
    override fun onCreate(savedInstanceState: Bundle?) {
        super.onCreate(savedInstanceState)
        val bundleDir = intent.getStringExtra("bundle_dir") ?: intent.getStringExtra("model_dir")
        val prompts = intent.getStringExtra("prompts")
        val repeat = intent.getIntExtra("repeat", intent.getIntExtra("num_iter", 1))
        val maxNewTokens = intent.getIntExtra("max_new_tokens", 128)
        val output = File(filesDir, intent.getStringExtra("output") ?: "benchmark_results.json")

        Thread {
            val report = try {
                requireNotNull(bundleDir) { "give the bundle directory: --es bundle_dir DIR" }
                requireNotNull(prompts) { "give the prompts file: --es prompts FILE.jsonl" }
                val json = Native.benchmark(
                    bundleDir.toByteArray(Charsets.UTF_8),
                    prompts.toByteArray(Charsets.UTF_8),
                    repeat,
                    maxNewTokens,
                    deviceInfo().toString().toByteArray(Charsets.UTF_8),
                ) { line -> Log.i(TAG, String(line, Charsets.UTF_8)) }
                String(json, Charsets.UTF_8)
            } catch (e: RuntimeException) {
                Log.e(TAG, "benchmark failed: ${e.message}")
                JSONObject().put("error", e.message ?: e.toString()).toString(2)
            } catch (e: LinkageError) { // an APK built without the NDK: no libmtp_demo_jni.so
                val message = getString(R.string.no_native_library, (e.cause ?: e).toString())
                Log.e(TAG, message)
                JSONObject().put("error", message).toString(2)
            }
            // Written beside and renamed into place: a reader never sees half a report.
            val partial = File(output.path + ".tmp")
            partial.writeText(report)
            if (!partial.renameTo(output)) Log.e(TAG, "cannot write $output")
            Log.i(TAG, "wrote $output")
            runOnUiThread { finish() }
        }.start()
    }

    /** What minibench's BenchmarkMetric.DeviceInfo records, plus the SoC and ABI. */
    private fun deviceInfo(): JSONObject {
        val memory = ActivityManager.MemoryInfo()
        getSystemService(ActivityManager::class.java).getMemoryInfo(memory)
        // Build.SOC_MODEL (API 31) read by name: the app also compiles against older android.jars.
        val soc = if (Build.VERSION.SDK_INT >= 31) {
            Build::class.java.getField("SOC_MODEL").get(null) as String
        } else {
            Build.HARDWARE
        }
        return JSONObject()
            .put("device", Build.BRAND)
            .put("arch", Build.MODEL)
            .put("soc", soc)
            .put("abi", Build.SUPPORTED_ABIS.firstOrNull() ?: "")
            .put("os", "Android ${Build.VERSION.RELEASE}")
            .put("totalMem", memory.totalMem)
            .put("availMem", memory.availMem)
    }

    private companion object {
        const val TAG = "mtp-bench"
    }
}
