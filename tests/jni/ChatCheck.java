import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import org.mtpedge.demo.Native;

/**
 * Drives the app's chat calls (the JNI library over the chat C API) on a real bundle, as the
 * app's chat screen does, and prints one JSON value per line for tests/test_android_demo.py:
 * args BUNDLE_DIR. Two engines hold the same conversation, one reusing the cache between turns
 * and one prefilling the whole conversation each turn.
 */
public final class ChatCheck {
  // utf8, text and quote: JniCheck's (compiled with it)

  /** One answer: {"result": ..., "pieces": [...]}; the listener stops after stopAfter pieces. */
  private static String answer(long chat, String options, int stopAfter) {
    List<String> pieces = new ArrayList<>();
    byte[] result =
        Native.chatGenerate(
            chat,
            JniCheck.utf8(options),
            p -> {
              pieces.add(JniCheck.text(p));
              return pieces.size() != stopAfter;
            });
    StringBuilder out = new StringBuilder("{\"result\": ").append(JniCheck.text(result));
    out.append(", \"pieces\": [");
    for (int i = 0; i < pieces.size(); i++) {
      out.append(i > 0 ? "," : "").append(JniCheck.quote(pieces.get(i)));
    }
    return out.append("]}").toString();
  }

  private static String error(Runnable call) {
    try {
      call.run();
      return JniCheck.quote("no exception");
    } catch (RuntimeException e) {
      return JniCheck.quote(e.getClass().getName() + ": " + e.getMessage());
    }
  }

  public static void main(String[] args) {
    long engine = Native.open(JniCheck.utf8(args[0])), other = Native.open(JniCheck.utf8(args[0]));
    long chat = Native.chatCreate(engine, JniCheck.utf8(""));
    long whole = Native.chatCreate(other, JniCheck.utf8(""));
    String options = "{\"max_new_tokens\": 16, \"temperature\": 0, \"speculative\": ";
    for (String speculative : new String[] {"false", "true"}) {
      Native.chatReset(chat);
      Native.chatReset(whole);
      for (String turn : new String[] {"the cat sat on the mat", "and then? the cat é 🤗"}) {
        boolean added = Native.chatAddUser(chat, JniCheck.utf8(turn));
        System.out.println(added && Native.chatAddUser(whole, JniCheck.utf8(turn)));
        System.out.println(answer(chat, options + speculative + "}", 0));
        System.out.println(answer(whole, options + speculative + ", \"reuse_cache\": false}", 0));
      }
    }
    // The stop button: the listener says stop after three pieces; the conversation goes on.
    Native.chatReset(chat);
    Native.chatAddUser(chat, JniCheck.utf8("hi, hi, hi, hi"));
    System.out.println(answer(chat, options + "true}", 3));
    Native.chatAddUser(chat, JniCheck.utf8("and then?"));
    System.out.println(answer(chat, options + "true}", 0));
    // A listener that throws: the exception reaches the caller unchanged.
    Native.chatAddUser(chat, JniCheck.utf8("again"));
    System.out.println(
        error(
            () ->
                Native.chatGenerate(
                    chat,
                    JniCheck.utf8("{}"),
                    p -> {
                      throw new IllegalStateException("listener stop");
                    })));
    // Errors of the core: a turn added twice, an answer with no turn.
    System.out.println(
        error(
            () -> {
              Native.chatAddUser(chat, JniCheck.utf8("one more"));
              Native.chatAddUser(chat, JniCheck.utf8("twice"));
            }));
    Native.chatReset(chat);
    System.out.println(error(() -> Native.chatGenerate(chat, JniCheck.utf8("{}"), p -> true)));
    // Turns until the context is full: chatAddUser says false; after a reset it takes turns.
    int turns = 0;
    while (Native.chatAddUser(chat, JniCheck.utf8("a".repeat(60) + " " + turns))) {
      answer(chat, "{\"max_new_tokens\": 4}", 0);
      turns++;
    }
    System.out.println(turns);
    Native.chatReset(chat);
    System.out.println(Native.chatAddUser(chat, JniCheck.utf8("the cat sat on the mat")));
    System.out.println(answer(chat, options + "false}", 0));
    Native.chatFree(chat);
    Native.chatFree(whole);
    Native.close(engine);
    Native.close(other);
  }
}
