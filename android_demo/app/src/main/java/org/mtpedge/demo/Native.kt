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
