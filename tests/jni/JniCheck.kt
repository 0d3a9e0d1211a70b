// Drives the app's Kotlin (Engine and Native, compiled from android_demo's sources) on a real
// bundle, and prints what came back, one JSON value per line, for tests/test_android_demo.py:
// args BUNDLE_DIR PROMPTS_JSONL PROMPT.
@file:JvmName("JniCheck")

package org.mtpedge.demo

import java.io.File
import java.io.FileDescriptor
import java.io.FileOutputStream
import java.io.PrintStream
import org.json.JSONArray
import org.json.JSONObject

/** Standard output in UTF-8 whatever the locale (the answers hold emoji). */
internal val out = PrintStream(FileOutputStream(FileDescriptor.out), true, "UTF-8")

/** The exception [call] throws, as a JSON string: "class: message". */
internal fun error(call: () -> Unit): String = try {
    call()
    JSONObject.quote("no exception")
} catch (e: RuntimeException) {
    JSONObject.quote("${e.javaClass.name}: ${e.message}")
}

fun main(args: Array<String>) {
    val (bundle, prompts, prompt) = args
    val engine = Engine.open(File(bundle))
    for (speculative in listOf(false, true)) {
        val pieces = mutableListOf<String>()
        val options = JSONObject()
            .put("max_new_tokens", 24)
            .put("speculative", speculative)
            .put("temperature", 0)
        out.println(engine.generate(prompt, options) { pieces.add(it) })
        out.println(JSONArray(pieces))
    }
    // A listener that throws: the exception reaches the caller, the VM goes on.
    val stop = IllegalStateException("listener stop")
    out.println(error { engine.generate(prompt, JSONObject()) { throw stop } })
    // The core's errors: bad options, a bundle that is not there.
    out.println(error { engine.generate(prompt, JSONObject().put("top_p", 7)) {} })
    engine.close()
    out.println(error { Engine.open(File("$bundle/does-not-exist-é")) })
    // The benchmark activity's call.
    val progress = mutableListOf<String>()
    val report = Native.benchmark(
        bundle.toByteArray(Charsets.UTF_8),
        prompts.toByteArray(Charsets.UTF_8),
        2,
        16,
        """{"device": "host"}""".toByteArray(Charsets.UTF_8),
    ) { line -> progress.add(String(line, Charsets.UTF_8)) }
    out.println(String(report, Charsets.UTF_8).replace("\n", " "))
    out.println(progress.size)
}
