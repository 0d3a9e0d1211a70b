#include "engine.h"

#include <cmath>
#include <fstream>
#include <sys/stat.h>

#include "errors.h"

namespace mtp {
namespace {

std::unique_ptr<Drafter> bundle_drafter(const Manifest& m, const std::string& kind,
                                        double confidence, Model& target) {
  if (kind == "mtp") {
    std::ifstream in(m.path("drafter_vocab"));
    nlohmann::json vocab = nlohmann::json::parse(in, nullptr, false);
    if (vocab.is_discarded() || !vocab.contains("draft_ids"))
      throw UserError(m.path("drafter_vocab") + " holds no draft_ids: re-export the bundle");
    auto ids = vocab["draft_ids"].get<std::vector<int64_t>>();
    if (m.drafter.contains("method")) {
      // A head that reads the target's cache: a method of the target's program, run on the
      // target's loaded program so that it reads and writes the same cache; it writes cache
      // slots, so drafting stops at the cache's end (runtime/bundle.py bundle_drafter).
      auto step = open_executorch_method_step(target, m.drafter["method"].get<std::string>());
      return std::make_unique<MtpDrafter>(std::move(step), std::move(ids), m.vocab_size,
                                          confidence, target.max_seq_len);
    }
    if (m.drafter.value("own_cache", false)) {
      // A self (EAGLE-style) head: a program of its own with its KV cache inside, fed the
      // verified rows in chunks of at most max_chunk; it writes its cache, so drafting stops at
      // the cache's end (runtime/bundle.py bundle_drafter).
      const int64_t chunk = m.drafter.value("max_chunk", int64_t(0));
      if (chunk < 1)
        throw UserError("the manifest's self-attending MTP drafter has no max_chunk: re-export "
                        "the bundle");
      return std::make_unique<MtpDrafter>(open_executorch_step(m.path("drafter"), chunk),
                                          std::move(ids), m.vocab_size, confidence,
                                          m.max_seq_len, /*feeds_context=*/true);
    }
    return std::make_unique<MtpDrafter>(open_executorch_step(m.path("drafter")), std::move(ids),
                                        m.vocab_size, confidence);
  }
  auto model = open_executorch_model(m.path("drafter"), m.max_seq_len, m.max_chunk, m.vocab_size);
  return std::make_unique<DraftModelDrafter>(std::move(model), confidence);
}

const std::string kHybridSuffix = "+ngram";

// The drafter named by `spec` (mtp_edge/cli.py build_drafter): none | ngram | bundle (the
// bundle's own) | mtp | draft-lm (the bundle's own, by name) | any of these + "+ngram" (prompt
// lookup first, the model where it finds nothing: HybridDrafter). Null for none.
std::unique_ptr<Drafter> make_drafter(const std::string& spec, const Manifest& m,
                                      const EngineOptions& options, Model& target) {
  const std::string own = m.drafter_kind();
  if (spec.size() > kHybridSuffix.size() &&
      spec.compare(spec.size() - kHybridSuffix.size(), kHybridSuffix.size(), kHybridSuffix) == 0) {
    auto model = make_drafter(spec.substr(0, spec.size() - kHybridSuffix.size()), m, options,
                              target);
    if (model == nullptr)
      throw UserError("--drafter " + spec + ": name a model drafter before +ngram, e.g. mtp+ngram");
    return std::make_unique<HybridDrafter>(std::move(model), options.ngram_max, options.ngram_min);
  }
  const std::string kind = spec == "bundle" ? own : spec;
  if (kind == "none") return nullptr;
  if (kind == "ngram") return std::make_unique<NgramDrafter>(options.ngram_max, options.ngram_min);
  if (kind == "mtp" || kind == "draft-lm") {
    if (kind != own)
      throw UserError("--drafter " + kind + ": this bundle carries a '" + own +
                      "' drafter; use it, none or ngram (or export another bundle)");
    return bundle_drafter(m, kind, options.draft_confidence, target);
  }
  throw UserError("--drafter takes none, ngram or the bundle's own (" + own +
                  "), optionally +ngram (e.g. " + (own == "draft-lm" ? own : "mtp") +
                  "+ngram), got " + spec);
}

// The bundle's drafting policy (set by mtp-export) where the options leave it open: its own
// model drafter behind a prompt lookup of drafter.lookup = "MIN-MAX" sizes, and its
// drafter.draft_confidence.
EngineOptions with_bundle_policy(const EngineOptions& options, const Manifest& m) {
  EngineOptions out = options;
  if (options.drafter == "bundle" && m.drafter.contains("lookup") &&
      m.drafter["lookup"].is_string()) {
    out.drafter = "bundle" + kHybridSuffix;
    if (!options.ngram_sizes_given) {
      const std::string sizes = m.drafter["lookup"].get<std::string>();
      const size_t dash = sizes.find('-');
      try {
        out.ngram_min = std::stoi(sizes.substr(0, dash));
        out.ngram_max = dash == std::string::npos ? out.ngram_min : std::stoi(sizes.substr(dash + 1));
      } catch (const std::exception&) {
        throw UserError("manifest drafter.lookup must be MIN-MAX, got '" + sizes +
                        "': re-export the bundle");
      }
    }
  }
  if (!options.draft_confidence_given && m.drafter.contains("draft_confidence") &&
      m.drafter["draft_confidence"].is_number())
    out.draft_confidence = m.drafter["draft_confidence"].get<double>();
  return out;
}

}  // namespace

Engine::Engine(const std::string& bundle_dir, const EngineOptions& options)
    : manifest_(Manifest::load(bundle_dir)) {
  const Manifest& m = manifest_;
  if (m.backend != "executorch")
    throw UserError("bundle backend '" + m.backend +
                    "' is not supported by the native runtime: use an android bundle");
  set_executorch_threads(options.threads);
  target_ = open_executorch_model(m.path("target"), m.max_seq_len, m.max_chunk, m.vocab_size);
  const EngineOptions chosen = with_bundle_policy(options, m);
  drafter_ = make_drafter(chosen.drafter, m, chosen, *target_);
#ifdef MTP_HAVE_TOKENIZER
  const std::string tokenizer_json = m.dir + "/tokenizer.json";
  struct stat s;
  if (stat(tokenizer_json.c_str(), &s) == 0) {
    try {
      tokenizer_.emplace(Tokenizer::load(tokenizer_json));
    } catch (const std::exception& e) {
      throw UserError("cannot load " + tokenizer_json + ": " + e.what());
    }
  }
#endif
}

Engine::~Engine() = default;

void Engine::check_k(int64_t k) const {
  if (k < 0 || k + 1 > target_->max_chunk)
    throw UserError("--k must be in 0.." + std::to_string(target_->max_chunk - 1) +
                    " (k drafts and the pending token go in one call of at most " +
                    std::to_string(target_->max_chunk) + " tokens), got " + std::to_string(k));
}

bool Engine::has_tokenizer() const {
#ifdef MTP_HAVE_TOKENIZER
  return tokenizer_.has_value();
#else
  return false;
#endif
}

std::vector<int64_t> Engine::encode_prompt(const std::string& text, bool chat) const {
#ifdef MTP_HAVE_TOKENIZER
  if (!tokenizer_) throw UserError("bundle " + manifest_.dir + " has no tokenizer.json");
  std::string rendered = text;
  if (chat && manifest_.has_chat_template) {  // no template: the text as it is, as in Python
    if (!manifest_.chat_format)
      throw UserError("bundle " + manifest_.dir +
                      " has no chat_format for the native runtime: re-export it with this "
                      "mtp-export, or feed raw text (--no-chat)");
    rendered = manifest_.chat_format->prefix + text + manifest_.chat_format->suffix;
  }
  std::vector<int64_t> ids;
  for (int32_t id : tokenizer_->encode(rendered)) ids.push_back(id);
  if (manifest_.add_bos && (ids.empty() || ids[0] != *manifest_.bos_id))
    ids.insert(ids.begin(), *manifest_.bos_id);
  return ids;
#else
  (void)text, (void)chat;
  throw UserError("this build of the native runtime has no tokenizer: give prompt_ids");
#endif
}

std::string Engine::decode(const std::vector<int64_t>& ids) const {
#ifdef MTP_HAVE_TOKENIZER
  if (!tokenizer_) throw UserError("bundle " + manifest_.dir + " has no tokenizer.json");
  return tokenizer_->decode(std::vector<int32_t>(ids.begin(), ids.end()));
#else
  (void)ids;
  throw UserError("this build of the native runtime has no tokenizer");
#endif
}

static double rounded(double x, int digits) {
  const double scale = std::pow(10.0, digits);
  return std::round(x * scale) / scale;
}

nlohmann::json stats_json(const GenerationStats& s) {
  return {
      {"generated_tokens", s.generated_tokens},
      {"verify_steps", s.verify_steps},
      {"tau", rounded(s.tau(), 4)},
      {"acceptance_rate", rounded(s.acceptance_rate(), 4)},
      {"ttft_ms", rounded(s.ttft_ms, 3)},
      {"decode_tokens_per_s", rounded(s.decode_tokens_per_s(), 3)},
      {"accepted_per_position", s.accepted_per_position},
      {"drafted_per_position", s.drafted_per_position},
      {"drafted_tokens", s.drafted_tokens},
      {"accepted_tokens", s.accepted_tokens},
      {"draft_ms", rounded(s.draft_seconds * 1e3, 3)},
      {"verify_ms", rounded(s.verify_seconds * 1e3, 3)},
  };
}

}  // namespace mtp
