/* mtp-edge native runtime: the C API the Android app's JNI layer (and any other host) calls.
 *
 * An engine is one opened bundle (manifest and hashes checked, target and drafter programs
 * loaded, tokenizer). A chat is a conversation on an engine that keeps its turns' K/V in the
 * target's cache, so that each turn prefills only what it adds. Calls on one engine (and its
 * chats) must not overlap; separate engines are independent. Errors come back as a message in
 * `err` (NUL-terminated, truncated to err_len). Token ids are checked against the vocabulary
 * before any kernel sees them.
 */
#ifndef MTP_EDGE_H
#define MTP_EDGE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What the calls returning int return. */
#define MTP_OK 0
#define MTP_ERROR 1
#define MTP_CONTEXT_FULL 2 /* the conversation fills the context: reset it */

typedef struct mtp_engine mtp_engine;
typedef struct mtp_chat mtp_chat;

/* Opens the bundle directory; NULL on failure (reason in err). */
mtp_engine* mtp_open(const char* bundle_dir, char* err, size_t err_len);
/* Free the engine's chats first. */
void mtp_close(mtp_engine* engine);

/* Receives text as it is generated (whole UTF-8 characters only). */
typedef void (*mtp_on_text)(const char* piece, void* user);

/* Generates from `prompt`, one turn of its own, prefilled whole. options_json (NULL or "" for
 * defaults):
 *   {"max_new_tokens": 128, "speculative": true, "k": <bundle's>, "temperature": 0,
 *    "top_k": 0, "top_p": 1, "seed": 0, "chat": true, "stop_strings": [],
 *    "drafter": <the bundle's>, "ngram_sizes": <the bundle's or "1-3">,
 *    "draft_confidence": <the bundle's or 0>, "fallback": false, "store": false}
 * drafter: the names mtp-run --drafter and mtp-runner --drafter take for a bundle: none,
 * ngram, the bundle's own model drafter by name (mtp or draft-lm), or mtp+ngram,
 * draft-lm+ngram (prompt lookup where the context repeats itself, the model drafter
 * elsewhere). Not given: the bundle's own drafter with its drafting policy (manifest
 * drafter.kind, behind a lookup of drafter.lookup's sizes when the manifest has one), as
 * mtp-run runs it. ngram_sizes ("MIN-MAX", the lookup's n-gram sizes) and draft_confidence (a
 * number in [0, 1): a model drafter stops drafting below it) override the bundle's policy, as
 * --ngram-sizes and --draft-confidence. A name the bundle cannot serve fails, with the names
 * it takes in err. Each drafter is built on its first call and kept until mtp_close (a model
 * drafter once per draft_confidence). fallback: true drafts each step only as many tokens as
 * the measured acceptance and call costs say pay (as mtp-run --fallback; output unchanged).
 * "speculative": false: plain decoding, whatever drafter is named.
 * store: true drafts also from the engine's store of past requests (the Python runtime's
 * --adapt store, runtime/answer_store.py): where the model drafter stops short of k (an MTP
 * head below draft_confidence; with drafter "ngram" the lookup; in X+ngram the lookup's drafts
 * stay as they are, as --adapt does), the most frequent continuation of the context's last 4,
 * 3 or 2 tokens in earlier requests goes on, when it followed at least twice and in at least
 * half of the cases. Output unchanged (greedy stays plain decoding's, sampling
 * the target's distribution). After the call the request (prompt and answer; for a chat the
 * conversation and its answer) enters the store, which the engine keeps across calls and chats
 * until mtp_close, bounded to its last 32768 tokens. The result then also has "store_tokens",
 * "store_requests", "store_drafts" (drafts the store made so far) and "store_extended" (drafts
 * of this call it extended).
 * stop_strings: non-empty texts; generation stops once the generated text contains one
 * (stop_reason "stop_string", as mtp-run --stop); "text" then ends before it, while the
 * streamed pieces include it.
 * On success writes {"text", "stop_reason", "token_ids", "prompt_tokens", "drafter",
 * "stats": {...}} (drafter: the name of the drafter used, "none" for plain decoding; stats as
 * mtp-run --json) to stats_json and returns MTP_OK; otherwise returns MTP_ERROR with the
 * reason in err. */
int mtp_generate(mtp_engine* engine, const char* prompt, const char* options_json,
                 mtp_on_text on_text, void* user, char* stats_json, size_t stats_len, char* err,
                 size_t err_len);

/* Keeps a request log for the engine in the folder `dir` (made when missing; the app's own
 * storage): from this call on, every generation on the engine that ends with an answer
 * (mtp_generate, mtp_chat_generate) appends its request as one JSON line to dir/requests.jsonl,
 * in mtp_edge/request_log.py's format, which `mtp-train --init HEADS --prompts DIR` (heads
 * refined on these requests), `mtp-bench --prompts DIR` and `mtp-runner --store-log DIR` read:
 *   {"time", "model", "messages": [{"role", "content"}...], "answer_ids", "finish_reason", "tau"}
 * messages: mtp_generate's prompt as one user message ("raw": true with "chat": false); for a
 * chat the conversation before the answer (its system prompt when one was given). Nothing else
 * is kept. Bounded: past file_bytes the file becomes requests.1.jsonl (older ones shift up),
 * and files beyond `keep` are deleted, so the folder holds at most about (keep + 1) x
 * file_bytes. A line that cannot be written leaves the answer as it was, with "log_error" in
 * its result. Nothing is written unless this is called. options_json (NULL or "" for
 * defaults): {"file_bytes": 8388608, "keep": 4, "seed_store": true}; seed_store: the engine's
 * store of past requests (the "store" option) takes in what the folder holds already (its
 * newest 32768 tokens), as a restarted server's does. dir NULL or "": logging stops (the files
 * stay). On success writes {"log": dir or null, "seeded_requests", "store_tokens",
 * "store_requests", "store_drafts"} to result_json and returns MTP_OK; otherwise MTP_ERROR
 * with the reason in err (a folder that cannot be written, a log line that is not JSON, with
 * its file and line), the engine's earlier log, if any, kept. */
int mtp_request_log(mtp_engine* engine, const char* dir, const char* options_json,
                    char* result_json, size_t result_len, char* err, size_t err_len);

/* A conversation on `engine`, rendered with the bundle's chat template; system_prompt NULL or
 * "" for the template's default. NULL on failure (a bundle without a chat format, or whose
 * template takes no system prompt when one is given). Free it before closing the engine. */
mtp_chat* mtp_chat_create(mtp_engine* engine, const char* system_prompt, char* err,
                          size_t err_len);
void mtp_chat_free(mtp_chat* chat);
/* Forgets every turn; the system prompt stays. */
void mtp_chat_reset(mtp_chat* chat);

/* Adds the user's next message. MTP_CONTEXT_FULL ("context full: ... reset the conversation"
 * in err, the conversation unchanged) when it and one token of answer do not fit the
 * context; MTP_ERROR when the last user turn has no answer yet, or for a bundle whose chat
 * format holds one turn only (exported before multi-turn chat). */
int mtp_chat_add_user(mtp_chat* chat, const char* text, char* err, size_t err_len);

/* Receives each generated token with the text it completes (whole UTF-8 characters only: ""
 * when the token ends inside a character, whose bytes come with a later token). Return
 * MTP_CONTINUE, or MTP_STOP to end the answer after this token (stop_reason "stopped"). */
#define MTP_CONTINUE 0
#define MTP_STOP 1
typedef int (*mtp_on_token)(int32_t token_id, const char* piece, void* user);

/* Generates the answer to the last user turn and adds it to the conversation (as generated;
 * a stopped answer as far as it got). The conversation's tokens that the target's cache
 * still holds (its earlier turns) are not prefilled again; the drafter sees the new rows.
 * options_json: as mtp_generate ("chat" aside), and "reuse_cache": false prefills the whole
 * conversation. On success writes {"text", "stop_reason", "token_ids", "drafter",
 * "prompt_tokens" (the conversation before the answer), "reused_tokens" (of those, already
 * in the cache), "prefilled_tokens", "cached_tokens" (in the cache after the answer),
 * "context_tokens" (the conversation after it), "max_seq_len", "stats": {...}} to result_json
 * and returns MTP_OK. stop_reason "context_full": the answer filled the context; the next
 * mtp_chat_add_user returns MTP_CONTEXT_FULL. */
int mtp_chat_generate(mtp_chat* chat, const char* options_json, mtp_on_token on_token,
                      void* user, char* result_json, size_t result_len, char* err,
                      size_t err_len);

/* The result JSON of the conversation's last answer (MTP_ERROR before the first). */
int mtp_chat_last_stats(const mtp_chat* chat, char* result_json, size_t result_len, char* err,
                        size_t err_len);

#ifdef __cplusplus
}
#endif

#endif /* MTP_EDGE_H */
