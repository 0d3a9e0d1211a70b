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

#include "bundle.h"
#include "drafters.h"
#include "loop.h"
#include "model.h"

#if __has_include("tokenizer.h")
#include "tokenizer.h"
#define MTP_HAVE_TOKENIZER 1
#endif

namespace mtp {

// Which drafter to decode with, by name: what mtp-runner's --drafter, --ngram-sizes and
// --draft-confidence and the C API's "drafter", "ngram_sizes" and "draft_confidence" set.
struct DrafterOptions {
  // bundle (the bundle's own) | none | ngram | mtp | draft-lm, or a model drafter's name
  // +ngram (bundle+ngram, mtp+ngram, draft-lm+ngram: prompt lookup where the context repeats
  // itself, the model drafter elsewhere)
  std::string drafter = "bundle";
  int ngram_min = 1, ngram_max = 3;
  double draft_confidence = 0.0;
  // Unless given, the bundle's drafting policy applies (manifest drafter.lookup: "bundle"
  // becomes "bundle+ngram" with those sizes; drafter.draft_confidence), as in runtime/assemble.py.
  bool ngram_sizes_given = false, draft_confidence_given = false;
};

struct EngineOptions : DrafterOptions {
  unsigned threads = 0;  // ExecuTorch thread pool size (0 = one per core)
};

// "MIN-MAX" (or "N": MIN = MAX = N) n-gram sizes as --ngram-sizes takes them; throws UserError
// naming `what` otherwise.
std::pair<int, int> parse_ngram_sizes(const std::string& text, const std::string& what);

class Engine {
 public:
  Engine(const std::string& bundle_dir, const EngineOptions& options);
  ~Engine();

  const Manifest& manifest() const { return manifest_; }
  Model& target() { return *target_; }
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

  // Prompt text -> ids ready for prefill: one user turn of the bundle's chat format when
  // `chat`, bos first when the tokenizer adds one. Throws UserError without a tokenizer.
  std::vector<int64_t> encode_prompt(const std::string& text, bool chat) const;
  std::string decode(const std::vector<int64_t>& ids) const;
  bool has_tokenizer() const;

 private:
  Manifest manifest_;
  std::unique_ptr<Model> target_;
  // Model drafters by kind and confidence, then the drafters handed out, by everything that
  // tells them apart (members are destroyed in reverse order: hybrids before the models they
  // use, all before the target whose program a draft method runs on).
  std::map<std::string, std::unique_ptr<Drafter>> models_;
  std::map<std::string, std::unique_ptr<Drafter>> drafters_;
  Drafter* drafter_ = nullptr;
#ifdef MTP_HAVE_TOKENIZER
  std::optional<Tokenizer> tokenizer_;
#endif
};

// GenerationStats as runtime/loop.py's GenerationStats.to_dict().
nlohmann::json stats_json(const GenerationStats& s);

}  // namespace mtp
