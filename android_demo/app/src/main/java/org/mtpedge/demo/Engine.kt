package org.mtpedge.demo

import java.io.File
import org.json.JSONObject

private fun String.utf8(): ByteArray = toByteArray(Charsets.UTF_8)

private fun ByteArray.text(): String = String(this, Charsets.UTF_8)

/** One opened bundle. Calls must not overlap (the core's rule): callers keep them on one thread. */
class Engine private constructor(internal var handle: Long) : AutoCloseable {

    /** Generates a reply to one message of its own; [onText] gets each piece of text. */
    fun generate(prompt: String, options: JSONObject, onText: (String) -> Unit): JSONObject {
        check(handle != 0L) { "engine is closed" }
        val result = Native.generate(handle, prompt.utf8(), options.toString().utf8()) { piece ->
            onText(piece.text())
        }
        return JSONObject(result.text())
    }

    /**
     * Keeps a log of the requests answered from now on in [dir], the app's own storage (null:
     * stop; the files stay), and lets the store of past requests start from what it holds, so
     * that drafting keeps what it learned across restarts. The same files refine the heads on a
     * computer: `mtp-train --init HEADS --prompts DIR`. The core's result JSON.
     */
    fun keepRequestLog(dir: File?, options: JSONObject = JSONObject()): JSONObject {
        check(handle != 0L) { "engine is closed" }
        val path = (dir?.path ?: "").utf8()
        return JSONObject(Native.requestLog(handle, path, options.toString().utf8()).text())
    }

    override fun close() {
        if (handle != 0L) {
            Native.close(handle)
            handle = 0L
        }
    }

    companion object {
        fun open(bundleDir: File): Engine = Engine(Native.open(bundleDir.path.utf8()))
    }
}

/**
 * What the settings sheet sets for each answer; k null: the bundle's own. [store]: the drafter
 * goes on from the app's earlier requests where it stops short (the core's store of past
 * requests: in memory, bounded, output unchanged). [remember] (off unless the user turns it on):
 * the requests are also kept in a log in the app's storage (Engine.keepRequestLog), from which
 * the store starts after a restart.
 */
data class Settings(
    val speculative: Boolean = true,
    val k: Int? = null,
    val temperature: Double = 0.0,
    val maxNewTokens: Int = 256,
    val store: Boolean = true,
    val remember: Boolean = false,
) {
    fun toJson(): JSONObject = JSONObject()
        .put("speculative", speculative)
        .put("temperature", temperature)
        .put("max_new_tokens", maxNewTokens)
        .put("store", store)
        .apply { k?.let { put("k", it) } }
}

/**
 * A conversation on [engine]. The core keeps its turns' K/V in the model's cache, so each
 * answer prefills only the new message. Close it before the engine.
 */
class Chat(engine: Engine, systemPrompt: String = "") : AutoCloseable {
    private var handle = Native.chatCreate(engine.handle, systemPrompt.utf8())

    /** Adds the user's message; false when the context is full (reset to go on). */
    fun addUser(text: String): Boolean = Native.chatAddUser(handle, text.utf8())

    /**
     * Generates the answer: [onPiece] gets its text as it comes and returns false to stop it
     * (the stop button). The core's result JSON: text, stop_reason, stats, prefilled_tokens...
     */
    fun answer(settings: Settings, onPiece: (String) -> Boolean): JSONObject {
        val result = Native.chatGenerate(handle, settings.toJson().toString().utf8()) { piece ->
            onPiece(piece.text())
        }
        return JSONObject(result.text())
    }

    fun reset() = Native.chatReset(handle)

    override fun close() {
        if (handle != 0L) {
            Native.chatFree(handle)
            handle = 0L
        }
    }
}
