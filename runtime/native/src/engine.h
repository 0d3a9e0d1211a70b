// An opened bundle: manifest (checked), target program, drafter, tokenizer. What the runner and
// the C API (the Android app's JNI) decode with.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "answer_store.h"
#include "bundle.h"
#include "drafters.h"
#include "errors.h"
#include "loop.h"
#include "model.h"

#if __has_include("tokenizer.h")
#include "tokenizer.h"
#define MTP_HAVE_TOKENIZER 1
#endif

namespace mtp {

// Which drafter to decode with, by name: what mtp-runner's --drafter, --ngram-sizes and
// --draft-confidence and the C API's "drafter", "ngram_sizes" and "draft_confidence" set. The
// names and defaults are runtime/assemble.py's (mtp-run --drafter), read from the same
// manifest fields.
struct DrafterOptions {
  // none | ngram | the bundle's own model drafter by its kind (mtp or draft-lm) | any of these
  // +ngram (mtp+ngram: prompt lookup where the context repeats itself, the model drafter
  // elsewhere). Unset: the bundle's drafter (manifest drafter.kind), behind a prompt lookup of
  // drafter.lookup's sizes when the manifest has one.
  std::optional<std::string> drafter;
  int ngram_min = 1, ngram_max = 3;  // the default sizes, runtime/assemble.py's "1-3"
  double draft_confidence = 0.0;
  // Unless given: the bundle's lookup sizes for its own drafter's lookup (else the default
  // above), its drafter.draft_confidence.
  bool ngram_sizes_given = false, draft_confidence_given = false;
  // The model drafter (the lookup for ngram alone) extended by the engine's store of past
  // requests where it stops short of k (StoreDrafter); inside X+ngram the lookup's drafts are
  // left as they are, as runtime/adapt.py adapting() wraps only a hybrid's model.
  bool store = false;
};

struct EngineOptions : DrafterOptions {
  unsigned threads = 0;  // ExecuTorch thread pool size (0 = one per core)
};

// Throws UserError, naming the drafters the bundle takes, unless `spec` is a drafter name that
// a bundle whose own drafter is `own` (manifest drafter.kind) serves.
void check_drafter_name(const std::string& spec, const std::string& own);

// Throws UserError for a token id outside 0..vocab_size - 1.
void check_token_ids(const std::vector<int64_t>& ids, int64_t vocab_size);

// "MIN-MAX" (or "N": MIN = MAX = N) n-gram sizes as --ngram-sizes takes them; throws UserError
// naming `what` otherwise.
std::pair<int, int> parse_ngram_sizes(const std::string& text, const std::string& what);

class Engine {
 public:
  Engine(const std::string& bundle_dir, const EngineOptions& options);
  ~Engine();

  const Manifest& manifest() const { return manifest_; }
  // The target, to run directly: what its cache holds is no longer known to generate().
  Model& target() {
    cached_.clear();
    return *target_;
  }
  // Generates from `prompt` on the target (loop.h generate, stop strings detokenized here, the
  // fallback reading costs() unless the config names other costs; check_token_ids first).
  // With reuse_cache, the longest prefix the target's cache shares with `prompt` (left by an
  // earlier call of this function) is not prefilled again.
  GenerationResult generate(const std::vector<int64_t>& prompt, Drafter* drafter,
                            const GenerationConfig& config, const OnToken& on_token,
                            bool reuse_cache);
  // The drafter the engine was opened with (EngineOptions); null: plain decoding only.
  Drafter* drafter() { return drafter_; }
  std::string drafter_name() const { return drafter_ ? drafter_->name() : "none"; }
  // The drafter `options` name, the bundle's policy where they leave it open, as the engine's
  // own is chosen; null for none. Built on first use and kept for the engine's life (a model
  // drafter once per draft confidence, shared by its X+ngram hybrids), so that later calls do
  // not load its program again. Throws UserError, naming the accepted drafters, for a name
  // this bundle cannot serve.
  Drafter* drafter(const DrafterOptions& options);
  // Throws UserError unless k drafts plus the pending token fit one target call.
  void check_k(int64_t k) const;
  // Throws UserError for a token id outside the target's vocabulary (before any kernel sees
  // it: the embedding kernel would abort the process).
  void check_token_ids(const std::vector<int64_t>& ids) const;
  // The target's call costs measured so far, which the fallback reads (kept across calls).
  StepCosts& costs() { return costs_; }
  // The store of past requests (answer_store.h) that generations asking for it draft from and
  // add their tokens to: made on first use, kept for the engine's life.
  AnswerStore& store();
  // Feeds the store the requests of a request log (mtp_edge/request_log.py: a folder's
  // requests*.jsonl, oldest first, or one such file), as mtp_edge/api.py _seed_store does: each
  // answered record's prompt (logged_prompt_ids) and answer_ids, skipping records with ids
  // outside the vocabulary (another model's). Returns the records added. Throws UserError, one
  // line naming the file and line, for a log that cannot be read.
  int64_t seed_store(const std::string& log);
  // A logged request's prompt ids as mtp_edge/api.py _logged_prompt_ids encodes them: a raw
  // prompt (one message with "raw": true) as plain text, else the conversation through the
  // chat format (an optional system message, then user and assistant turns alternating, the
  // user's last; a system message folded into the first user message, as the Python tokenizer
  // does, when the template has no system frame). Empty where it cannot be encoded here.
  std::vector<int64_t> logged_prompt_ids(const nlohmann::json& messages) const;

  // Prompt text -> ids ready for prefill: one user turn of the bundle's chat format when
  // `chat`, bos first when the tokenizer adds one. Throws UserError without a tokenizer.
  std::vector<int64_t> encode_prompt(const std::string& text, bool chat) const;
  std::string decode(const std::vector<int64_t>& ids) const;
  bool has_tokenizer() const;
  // Pieces of a chat (template text, then what was typed, alternately: template, text,
  // template, ...) -> ids (no bos), the template's special tokens recognised and those typed
  // in a text encoded as text. Exactly the ids of the joined text unless two texts both hold
  // special tokens' text: then each text is encoded with the template before it.
  std::vector<int64_t> encode_chat(const std::vector<std::string>& pieces) const;

 private:
  Manifest manifest_;
  std::unique_ptr<Model> target_;
  // Model drafters by kind and confidence, then the drafters handed out, by everything that
  // tells them apart (members are destroyed in reverse order: hybrids before the models they
  // use, all before the target whose program a draft method runs on).
  std::map<std::string, std::unique_ptr<Drafter>> models_;
  std::map<std::string, std::unique_ptr<Drafter>> drafters_;
  Drafter* drafter_ = nullptr;
  std::vector<int64_t> cached_;  // the tokens whose K/V the target's cache holds, if known
  StepCosts costs_;
  std::unique_ptr<AnswerStore> store_;
#ifdef MTP_HAVE_TOKENIZER
  std::optional<Tokenizer> tokenizer_;
#endif
};

// The conversation no longer fits the target's context: reset it (or start another).
struct ContextFull : UserError {
  using UserError::UserError;
};

// A multi-turn chat on an engine, rendered with the bundle's chat format (ChatFormat: the
// template's pieces, concatenated) and kept as token ids: the answers as generated, so that
// each turn finds the conversation so far in the target's cache and prefills only what the
// new turn adds. Several conversations may share an engine (each turn then reuses what the
// cache still shares with it). Drafters catch up as in one generation: MTP heads read the
// hidden states of the rows prefilled, the n-gram lookup the whole conversation, a draft model
// its own cache's longest shared prefix; a self (EAGLE) head's own cache misses the rows of
// earlier turns it was not run on (answers decoded without it; an answer's last step it takes
// in at the answer's end), which lowers its acceptance, never changes the tokens.
class Conversation {
 public:
  // An empty system_prompt: the template's default. Throws UserError when the bundle has no
  // chat format, or takes no system prompt and one is given.
  Conversation(Engine& engine, std::string system_prompt);

  // Appends a user turn; throws ContextFull (the conversation unchanged) when it, and one
  // token of answer, do not fit, UserError when the last user turn has no answer yet.
  void add_user(const std::string& text);
  struct Answer {
    GenerationResult generation;
    int64_t prompt_tokens = 0;  // the conversation up to the answer
  };
  // Generates the answer to the last user turn and appends it (as generated, eos left out; a
  // stopped answer as far as it got). reuse_cache false prefills the whole conversation.
  Answer answer(Drafter* drafter, const GenerationConfig& config, const OnToken& on_token,
                bool reuse_cache = true);
  // Forgets every turn (the system prompt stays); the cache keeps serving what it shares.
  void reset();

  const std::vector<int64_t>& tokens() const { return tokens_; }

 private:
  Engine& engine_;
  const ChatFormat* format_;
  std::string system_prompt_;
  std::vector<int64_t> tokens_;
  bool awaiting_answer_ = false;
};

// GenerationStats as runtime/loop.py's GenerationStats.to_dict().
nlohmann::json stats_json(const GenerationStats& s);

// The store's numbers under the names of runtime/answer_store.py's report(): store_tokens,
// store_requests, store_drafts.
nlohmann::json store_json(const AnswerStore& store);

}  // namespace mtp
