package org.mtpedge.demo

/**
 * The JNI library (src/main/cpp/mtp_jni.cpp) over the C++ runtime core. Strings cross as UTF-8
 * byte arrays: JNI's own string conversion is "modified UTF-8", which would corrupt emoji.
 */
internal object Native {
    init {
        System.loadLibrary("mtp_demo_jni")
    }

    fun interface TextListener {
        fun onText(piece: ByteArray)
    }

    fun interface ProgressListener {
        fun onProgress(line: ByteArray)
    }

    /** Gets each piece of an answer's text; returns false to stop the answer there. */
    fun interface TokenListener {
        fun onToken(piece: ByteArray): Boolean
    }

    /** Opens a bundle directory; throws RuntimeException with the core's message. */
    @JvmStatic external fun open(bundleDir: ByteArray): Long

    @JvmStatic external fun close(handle: Long)

    /** The core's result JSON; [listener] gets the text as it is generated. */
    @JvmStatic external fun generate(
        handle: Long,
        prompt: ByteArray,
        optionsJson: ByteArray,
        listener: TextListener,
    ): ByteArray

    /**
     * Keeps a request log in [dir] (empty: logging stops), seeding the store from it; the
     * core's result JSON. Throws RuntimeException with the core's message.
     */
    @JvmStatic external fun requestLog(
        handle: Long,
        dir: ByteArray,
        optionsJson: ByteArray,
    ): ByteArray

    /** A conversation on an engine (empty system prompt: the template's default). */
    @JvmStatic external fun chatCreate(handle: Long, systemPrompt: ByteArray): Long

    @JvmStatic external fun chatFree(chat: Long)

    /** Forgets every turn. */
    @JvmStatic external fun chatReset(chat: Long)

    /** Adds the user's message; false when the context is full (reset the conversation). */
    @JvmStatic external fun chatAddUser(chat: Long, text: ByteArray): Boolean

    /** Generates the answer to the last user turn; the core's result JSON. */
    @JvmStatic external fun chatGenerate(
        chat: Long,
        optionsJson: ByteArray,
        listener: TokenListener,
    ): ByteArray

    /** Plain vs speculative over a prompts file (mtp-runner's format); the report JSON. */
    @JvmStatic external fun benchmark(
        bundleDir: ByteArray,
        promptsPath: ByteArray,
        repeat: Int,
        maxNewTokens: Int,
        deviceJson: ByteArray,
        progress: ProgressListener,
    ): ByteArray
}
