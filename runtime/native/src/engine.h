// An opened bundle: manifest (checked), target program, drafter, tokenizer. What the runner and
// the C API (the Android app's JNI) decode with.
#pragma once

#include <memory>
#include <optional>
#include <string>
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

struct EngineOptions {
  // bundle (the bundle's own) | none | ngram | mtp | draft-lm, or any of these +ngram (e.g.
  // mtp+ngram: prompt lookup where the context repeats itself, the model drafter elsewhere)
  std::string drafter = "bundle";
  int ngram_min = 1, ngram_max = 3;
  double draft_confidence = 0.0;
  // Unless given, the bundle's drafting policy applies (manifest drafter.lookup: "bundle"
  // becomes "bundle+ngram" with those sizes; drafter.draft_confidence), as in mtp_edge/cli.py.
  bool ngram_sizes_given = false, draft_confidence_given = false;
  unsigned threads = 0;  // ExecuTorch thread pool size (0 = one per core)
};

class Engine {
 public:
  Engine(const std::string& bundle_dir, const EngineOptions& options);
  ~Engine();

  const Manifest& manifest() const { return manifest_; }
  Model& target() { return *target_; }
  Drafter* drafter() { return drafter_.get(); }  // null: plain decoding only
  std::string drafter_name() const { return drafter_ ? drafter_->name() : "none"; }
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
  std::unique_ptr<Drafter> drafter_;
#ifdef MTP_HAVE_TOKENIZER
  std::optional<Tokenizer> tokenizer_;
#endif
};

// GenerationStats as runtime/loop.py's GenerationStats.to_dict().
nlohmann::json stats_json(const GenerationStats& s);

}  // namespace mtp
