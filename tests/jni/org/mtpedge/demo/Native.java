package org.mtpedge.demo;

/**
 * The JVM view of android_demo's JNI library, declared exactly as the app's Kotlin
 * `object Native` compiles (static natives on org.mtpedge.demo.Native), so the host test calls
 * the same symbols with the same signatures. No Kotlin compiler here, hence Java.
 */
public final class Native {
  static {
    System.loadLibrary("mtp_demo_jni");
  }

  public interface TextListener {
    void onText(byte[] piece);
  }

  public interface ProgressListener {
    void onProgress(byte[] line);
  }

  public interface TokenListener {
    boolean onToken(byte[] piece);
  }

  public static native long open(byte[] bundleDir);

  public static native void close(long handle);

  public static native byte[] generate(
      long handle, byte[] prompt, byte[] optionsJson, TextListener listener);

  public static native long chatCreate(long handle, byte[] systemPrompt);

  public static native void chatFree(long chat);

  public static native void chatReset(long chat);

  public static native boolean chatAddUser(long chat, byte[] text);

  public static native byte[] chatGenerate(long chat, byte[] optionsJson, TokenListener listener);

  public static native byte[] benchmark(
      byte[] bundleDir,
      byte[] promptsPath,
      int repeat,
      int maxNewTokens,
      byte[] deviceJson,
      ProgressListener progress);

  private Native() {}
}
