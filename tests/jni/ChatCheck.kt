// Holds conversations with the app's Chat (android_demo's Engine.kt over the JNI library and the
// chat C API) on a real bundle, as the chat screen does, and prints one JSON value per line for
// tests/test_android_demo.py: args BUNDLE_DIR LOG_DIR. A second conversation, through the bindings
// (Native) with the cache not reused, prefills the whole conversation each turn: the reference.
@file:JvmName("ChatCheck")

package org.mtpedge.demo

import java.io.File
import org.json.JSONArray
import org.json.JSONObject

private fun String.utf8(): ByteArray = toByteArray(Charsets.UTF_8)

/** {"result": the core's result, "pieces": what the listener got}. */
private fun line(result: JSONObject, pieces: List<String>): JSONObject =
    JSONObject().put("result", result).put("pieces", JSONArray(pieces))

/** One answer of [chat]; the listener says stop after [stopAfter] pieces (0: never). */
private fun answer(chat: Chat, settings: Settings, stopAfter: Int = 0): JSONObject {
    val pieces = mutableListOf<String>()
    val result = chat.answer(settings) { piece ->
        pieces.add(piece)
        pieces.size != stopAfter
    }
    return line(result, pieces)
}

/** The reference: the answer after a prefill of the whole conversation. */
private fun wholeAnswer(chat: Long, settings: Settings): JSONObject {
    val pieces = mutableListOf<String>()
    val options = settings.toJson().put("reuse_cache", false).toString().utf8()
    val result = Native.chatGenerate(chat, options) { piece ->
        pieces.add(String(piece, Charsets.UTF_8))
        true
    }
    return line(JSONObject(String(result, Charsets.UTF_8)), pieces)
}

fun main(args: Array<String>) {
    val engine = Engine.open(File(args[0]))
    val other = Engine.open(File(args[0]))
    val chat = Chat(engine)
    val whole = Native.chatCreate(other.handle, "".utf8())
    for (speculative in listOf(false, true)) {
        val settings = Settings(speculative = speculative, temperature = 0.0, maxNewTokens = 16)
        chat.reset()
        Native.chatReset(whole)
        for (turn in listOf("the cat sat on the mat", "and then? the cat é 🤗")) {
            val added = chat.addUser(turn)
            out.println(added && Native.chatAddUser(whole, turn.utf8()))
            out.println(answer(chat, settings))
            out.println(wholeAnswer(whole, settings))
        }
    }
    val greedy = Settings(speculative = true, temperature = 0.0, maxNewTokens = 16)
    // The stop button: the listener says stop after three pieces; the conversation goes on.
    chat.reset()
    chat.addUser("hi, hi, hi, hi")
    out.println(answer(chat, greedy, stopAfter = 3))
    chat.addUser("and then?")
    out.println(answer(chat, greedy))
    // A listener that throws: the exception reaches the caller unchanged.
    chat.addUser("again")
    out.println(error { chat.answer(Settings()) { throw IllegalStateException("listener stop") } })
    // Errors of the core: a turn added twice, an answer with no turn.
    out.println(
        error {
            chat.addUser("one more")
            chat.addUser("twice")
        },
    )
    chat.reset()
    out.println(error { chat.answer(Settings()) { true } })
    // Turns until the context is full: addUser says false; after a reset it takes turns.
    var turns = 0
    while (chat.addUser("a".repeat(60) + " " + turns)) {
        answer(chat, Settings(maxNewTokens = 4))
        turns++
    }
    out.println(turns)
    chat.reset()
    out.println(chat.addUser("the cat sat on the mat"))
    out.println(answer(chat, greedy.copy(speculative = false)))
    // "Remember my requests": a log in the app's storage (args[1]) that each answered turn goes
    // into, and from which another engine's store starts; a folder that cannot be made refused.
    val log = File(args[1])
    out.println(engine.keepRequestLog(log, JSONObject().put("file_bytes", 4096)))
    chat.reset()
    chat.addUser("the cat sat on the mat")
    out.println(answer(chat, greedy.copy(store = true)))
    out.println(engine.keepRequestLog(null))
    val restarted = Engine.open(File(args[0]))
    out.println(restarted.keepRequestLog(log))
    restarted.close()
    out.println(error { engine.keepRequestLog(File(File(args[0], "manifest.json"), "log")) })
    chat.close()
    Native.chatFree(whole)
    engine.close()
    other.close()
}
