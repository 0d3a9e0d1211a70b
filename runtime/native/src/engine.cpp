#include "engine.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <tuple>

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
    if (m.drafter.method) {
      // A head that reads the target's cache: a method of the target's program, run on the
      // target's loaded program so that it reads and writes the same cache; it writes cache
      // slots, so drafting stops at the cache's end (runtime/bundle.py bundle_drafter).
      auto step = open_executorch_method_step(target, *m.drafter.method);
      return std::make_unique<MtpDrafter>(std::move(step), std::move(ids), m.vocab_size,
                                          confidence, target.max_seq_len);
    }
    if (m.drafter.own_cache) {
      // A self (EAGLE-style) head: a program of its own with its KV cache inside, fed the
      // verified rows in chunks of at most max_chunk; it writes its cache, so drafting stops at
      // the cache's end (runtime/bundle.py bundle_drafter).
      const int64_t chunk = m.drafter.max_chunk;
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

bool is_hybrid(const std::string& spec) {
  return spec.size() > kHybridSuffix.size() &&
         spec.compare(spec.size() - kHybridSuffix.size(), kHybridSuffix.size(), kHybridSuffix) == 0;
}

// The drafter names a bundle whose own drafter is `own` serves, for messages.
std::string accepted_drafters(const std::string& own) {
  if (own == "mtp" || own == "draft-lm")
    return "none, ngram, bundle, " + own + ", bundle+ngram or " + own + "+ngram";
  return "none, ngram or bundle";
}

// `spec` with the bundle's own drafter for "bundle" (bundle+ngram -> mtp+ngram, say).
std::string resolve_bundle(const std::string& spec, const std::string& own) {
  if (spec == "bundle") return own;
  if (spec == "bundle" + kHybridSuffix) return own + kHybridSuffix;
  return spec;
}

// The drafter named by `spec` (runtime/assemble.py build_drafter): none | ngram | bundle (the
// bundle's own) | mtp | draft-lm (the bundle's own, by name) | any of these + "+ngram" (prompt
// lookup first, the model where it finds nothing: HybridDrafter). Null for none. `model(kind)`
// gives the bundle's model drafter. Throws UserError naming what the bundle takes.
std::unique_ptr<Drafter> make_drafter(
    const std::string& spec, const std::string& own, const DrafterOptions& options,
    const std::function<std::unique_ptr<Drafter>(const std::string&)>& model) {
  auto refuse = [&](const std::string& name, const std::string& why) {
    return UserError("drafter '" + name + "': " + why + "; it takes " + accepted_drafters(own));
  };
  if (is_hybrid(spec)) {
    auto inner = make_drafter(spec.substr(0, spec.size() - kHybridSuffix.size()), own, options,
                              model);
    if (inner == nullptr) throw refuse(spec, "name a model drafter before +ngram");
    return std::make_unique<HybridDrafter>(std::move(inner), options.ngram_max, options.ngram_min);
  }
  const std::string kind = spec == "bundle" ? own : spec;
  if (kind == "none") return nullptr;
  if (kind == "ngram") return std::make_unique<NgramDrafter>(options.ngram_max, options.ngram_min);
  if (kind == "mtp" || kind == "draft-lm") {
    if (kind != own)
      throw refuse(spec, own == "none" ? "this bundle carries no model drafter"
                                       : "this bundle carries a '" + own +
                                             "' drafter (export another bundle for " + kind + ")");
    return model(kind);
  }
  throw UserError("unknown drafter '" + spec + "': this bundle takes " + accepted_drafters(own));
}

// The bundle's drafting policy (set by mtp-export) where the options leave it open: its own
// model drafter behind a prompt lookup of drafter.lookup = "MIN-MAX" sizes, and its
// drafter.draft_confidence.
DrafterOptions with_bundle_policy(const DrafterOptions& options, const Manifest& m) {
  DrafterOptions out = options;
  if (options.drafter == "bundle" && m.drafter.lookup) {
    out.drafter = "bundle" + kHybridSuffix;
    if (!options.ngram_sizes_given) {
      const std::string sizes = *m.drafter.lookup;
      try {
        std::tie(out.ngram_min, out.ngram_max) = parse_ngram_sizes(sizes, "drafter.lookup");
      } catch (const UserError&) {
        throw UserError("manifest drafter.lookup must be MIN-MAX, got '" + sizes +
                        "': re-export the bundle");
      }
    }
  }
  if (!options.draft_confidence_given) out.draft_confidence = m.drafter.draft_confidence;
  return out;
}

std::string exact(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", x);
  return text;
}

}  // namespace

std::pair<int, int> parse_ngram_sizes(const std::string& text, const std::string& what) {
  const size_t dash = text.find('-');
  auto number = [&](const std::string& part) {
    std::istringstream in(part);
    int n;
    if (part.empty() || !std::isdigit(static_cast<unsigned char>(part[0])) || !(in >> n) ||
        !in.eof())
      throw UserError(what + " takes MIN-MAX such as 1-3, got '" + text + "'");
    return n;
  };
  const int low = number(text.substr(0, dash));
  return {low, dash == std::string::npos ? low : number(text.substr(dash + 1))};
}

Engine::Engine(const std::string& bundle_dir, const EngineOptions& options)
    : manifest_(Manifest::load(bundle_dir)) {
  const Manifest& m = manifest_;
  if (m.backend != "executorch")
    throw UserError("bundle backend '" + m.backend +
                    "' is not supported by the native runtime: use an android bundle");
  set_executorch_threads(options.threads);
  target_ = open_executorch_model(m.path("target"), m.max_seq_len, m.max_chunk, m.vocab_size,
                                  m.models.at("target").attention == "mtp");
  drafter_ = drafter(options);
#ifdef MTP_HAVE_TOKENIZER
  // Through its manifest entry (every bundle has one), so that what is read is what was checked.
  const std::string tokenizer_json = m.path("tokenizer");
  try {
    tokenizer_.emplace(Tokenizer::load(tokenizer_json));
  } catch (const std::exception& e) {
    throw UserError("cannot load " + tokenizer_json + ": " + e.what());
  }
#endif
}

Engine::~Engine() = default;

Drafter* Engine::drafter(const DrafterOptions& options) {
  const DrafterOptions chosen = with_bundle_policy(options, manifest_);
  const std::string own = manifest_.drafter_kind();
  // The key tells apart what changes the drafter: its name ("bundle" resolved), the lookup's
  // sizes if it has one, the model's confidence floor if it has one.
  const std::string name = resolve_bundle(chosen.drafter, own);
  const std::string base = is_hybrid(name) ? name.substr(0, name.size() - kHybridSuffix.size())
                                           : name;
  std::string key = name;
  if (base == "ngram" || is_hybrid(name))
    key += " n=" + std::to_string(chosen.ngram_min) + "-" + std::to_string(chosen.ngram_max);
  const std::string confidence = exact(chosen.draft_confidence);
  if (base == "mtp" || base == "draft-lm") key += " p=" + confidence;
  const auto found = drafters_.find(key);
  if (found != drafters_.end()) return found->second.get();
  auto model = [&](const std::string& kind) -> std::unique_ptr<Drafter> {
    std::unique_ptr<Drafter>& kept = models_[kind + " p=" + confidence];
    if (kept == nullptr) {
      try {
        kept = bundle_drafter(manifest_, kind, chosen.draft_confidence, *target_);
      } catch (...) {
        models_.erase(kind + " p=" + confidence);
        throw;
      }
    }
    return std::make_unique<ForwardingDrafter>(kept.get());
  };
  auto made = make_drafter(chosen.drafter, own, chosen, model);
  Drafter* out = made.get();
  drafters_[key] = std::move(made);
  return out;
}

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
  // Special tokens typed in the user's text are text, the template's own markers stay
  // special (mtp_edge/tokenizer.py encode_prompt): user text cannot end its turn.
  std::vector<int32_t> encoded;
  if (chat && manifest_.has_chat_template) {  // no template: the text as it is, as in Python
    if (!manifest_.chat_format)
      throw UserError("bundle " + manifest_.dir +
                      " has no chat_format for the native runtime: re-export it with this "
                      "mtp-export, or feed raw text (--no-chat)");
    const auto& f = *manifest_.chat_format;
    encoded = tokenizer_->holds_special(text) ? tokenizer_->encode_framed(f.prefix, text, f.suffix)
                                              : tokenizer_->encode(f.prefix + text + f.suffix);
  } else {
    encoded = tokenizer_->encode(text, /*parse_special=*/false);
  }
  std::vector<int64_t> ids;
  for (int32_t id : encoded) ids.push_back(id);
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
