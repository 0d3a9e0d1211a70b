/* mtp-edge native runtime: the C API the Android app's JNI layer (and any other host) calls.
 *
 * An engine is one opened bundle (manifest and hashes checked, target and drafter programs
 * loaded, tokenizer). Calls on one engine must not overlap; separate engines are independent.
 * Errors come back as a message in `err` (NUL-terminated, truncated to err_len).
 */
#ifndef MTP_EDGE_H
#define MTP_EDGE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mtp_engine mtp_engine;

/* Opens the bundle directory; NULL on failure (reason in err). */
mtp_engine* mtp_open(const char* bundle_dir, char* err, size_t err_len);
void mtp_close(mtp_engine* engine);

/* Receives text as it is generated (whole UTF-8 characters only). */
typedef void (*mtp_on_text)(const char* piece, void* user);

/* Generates from `prompt`. options_json (NULL or "" for defaults):
 *   {"max_new_tokens": 128, "speculative": true, "k": <bundle's>, "temperature": 0,
 *    "top_p": 1, "seed": 0, "chat": true, "stop_strings": [], "drafter": "bundle",
 *    "ngram_sizes": <"1-3" or the bundle's>, "draft_confidence": <bundle's or 0>}
 * drafter: the names mtp-runner --drafter takes: none, ngram, bundle (the bundle's own, with
 * its drafting policy: the default), the bundle's own model drafter by name (mtp or
 * draft-lm), or bundle+ngram, mtp+ngram, draft-lm+ngram (prompt lookup where the context
 * repeats itself, the model drafter elsewhere). ngram_sizes ("MIN-MAX", the lookup's n-gram
 * sizes) and draft_confidence (a number in [0, 1): a model drafter stops drafting below it)
 * override the bundle's policy, as --ngram-sizes and --draft-confidence. A name the bundle
 * cannot serve fails, with the names it takes in err. Each drafter is built on its first
 * call and kept until mtp_close (a model drafter once per draft_confidence).
 * "speculative": false: plain decoding, whatever drafter is named.
 * stop_strings: non-empty texts; generation stops once the generated text contains one
 * (stop_reason "stop_string", as mtp-run --stop); "text" then ends before it, while the
 * streamed pieces include it.
 * On success writes {"text", "stop_reason", "token_ids", "prompt_tokens", "drafter",
 * "stats": {...}} (drafter: the name of the drafter used, "none" for plain decoding; stats as
 * mtp-run --json) to stats_json and returns 0; otherwise returns non-zero with the reason in
 * err. */
int mtp_generate(mtp_engine* engine, const char* prompt, const char* options_json,
                 mtp_on_text on_text, void* user, char* stats_json, size_t stats_len, char* err,
                 size_t err_len);

#ifdef __cplusplus
}
#endif

#endif /* MTP_EDGE_H */
