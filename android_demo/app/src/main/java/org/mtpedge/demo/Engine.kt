package org.mtpedge.demo

import java.io.File
import org.json.JSONObject

/** One opened bundle. Calls must not overlap (the core's rule): callers keep them on one thread. */
class Engine private constructor(private var handle: Long) : AutoCloseable {

    /** Generates a reply; [onText] receives each piece of text, on the calling thread. */
    fun generate(prompt: String, options: JSONObject, onText: (String) -> Unit): JSONObject {
        check(handle != 0L) { "engine is closed" }
        val result = Native.generate(
            handle,
            prompt.toByteArray(Charsets.UTF_8),
            options.toString().toByteArray(Charsets.UTF_8),
        ) { piece -> onText(String(piece, Charsets.UTF_8)) }
        return JSONObject(String(result, Charsets.UTF_8))
    }

    override fun close() {
        if (handle != 0L) {
            Native.close(handle)
            handle = 0L
        }
    }

    companion object {
        fun open(bundleDir: File): Engine =
            Engine(Native.open(bundleDir.path.toByteArray(Charsets.UTF_8)))
    }
}
