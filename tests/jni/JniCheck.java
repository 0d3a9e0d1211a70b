import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import org.mtpedge.demo.Native;

/**
 * Drives the app's JNI library on a real bundle and prints what came back, one JSON value per
 * line, for tests/test_android_demo.py to check: args BUNDLE_DIR PROMPTS_JSONL PROMPT.
 */
public final class JniCheck {
  static byte[] utf8(String s) {
    return s.getBytes(StandardCharsets.UTF_8);
  }

  static String text(byte[] b) {
    return new String(b, StandardCharsets.UTF_8);
  }

  /** A JSON string literal (the test parses it back). */
  static String quote(String s) {
    StringBuilder out = new StringBuilder("\"");
    for (int i = 0; i < s.length(); i++) {
      char c = s.charAt(i);
      if (c == '"' || c == '\\') out.append('\\').append(c);
      else if (c < 0x20) out.append(String.format("\\u%04x", (int) c));
      else out.append(c);
    }
    return out.append('"').toString();
  }

  public static void main(String[] args) {
    String bundle = args[0], prompts = args[1], prompt = args[2];
    long engine = Native.open(utf8(bundle));
    for (boolean speculative : new boolean[] {false, true}) {
      List<String> pieces = new ArrayList<>();
      String options =
          "{\"max_new_tokens\": 24, \"speculative\": " + speculative + ", \"temperature\": 0}";
      byte[] result =
          Native.generate(engine, utf8(prompt), utf8(options), p -> pieces.add(text(p)));
      System.out.println(text(result).replace("\n", " "));
      StringBuilder streamed = new StringBuilder("[");
      for (int i = 0; i < pieces.size(); i++) streamed.append(i > 0 ? "," : "").append(quote(pieces.get(i)));
      System.out.println(streamed.append("]"));
    }
    // A listener that throws: the exception must reach the caller, not crash the VM.
    try {
      Native.generate(
          engine,
          utf8(prompt),
          utf8("{}"),
          p -> {
            throw new IllegalStateException("listener stop");
          });
      System.out.println(quote("no exception"));
    } catch (IllegalStateException e) {
      System.out.println(quote(e.getClass().getName() + ": " + e.getMessage()));
    }
    try {
      Native.generate(engine, utf8(prompt), utf8("{\"top_p\": 7}"), p -> {});
      System.out.println(quote("no exception"));
    } catch (RuntimeException e) {
      System.out.println(quote(e.getMessage()));
    }
    Native.close(engine);
    try {
      Native.open(utf8(bundle + "/does-not-exist-é"));
      System.out.println(quote("no exception"));
    } catch (RuntimeException e) {
      System.out.println(quote(e.getMessage()));
    }
    List<String> progress = new ArrayList<>();
    byte[] report =
        Native.benchmark(
            utf8(bundle), utf8(prompts), 2, 16, utf8("{\"device\": \"host\"}"),
            line -> progress.add(text(line)));
    System.out.println(text(report).replace("\n", " "));
    System.out.println(progress.size());
  }
}
