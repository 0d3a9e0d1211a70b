#include "engine.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <tuple>

#include "errors.h"
#include "request_log.h"

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
  if (own == "mtp" || own == "draft-lm") return "none, ngram, " + own + " or " + own + "+ngram";
  return "none or ngram";
}

// The drafter named by `spec` (runtime/assemble.py build_drafter, for a bundle): none | ngram |
// the bundle's own model drafter by its kind (mtp or draft-lm) | any of these + "+ngram"
// (prompt lookup first, the model where it finds nothing: HybridDrafter). Null for none.
// `model(kind)` gives the bundle's model drafter. Throws UserError naming what the bundle takes.
std::unique_ptr<Drafter> make_drafter(
    const std::string& spec, const std::string& own, const DrafterOptions& options,
    const std::function<std::unique_ptr<Drafter>(const std::string&)>& model) {
  check_drafter_name(spec, own);
  if (is_hybrid(spec)) {
    auto inner = make_drafter(spec.substr(0, spec.size() - kHybridSuffix.size()), own, options,
                              model);
    return std::make_unique<HybridDrafter>(std::move(inner), options.ngram_max, options.ngram_min);
  }
  if (spec == "none") return nullptr;
  if (spec == "ngram") return std::make_unique<NgramDrafter>(options.ngram_max, options.ngram_min);
  return model(spec);
}

// The options with runtime/assemble.py's defaults from the manifest where they leave a choice
// open: no drafter named, the bundle's drafter.kind, behind a lookup of drafter.lookup =
// "MIN-MAX" sizes when it has one (those sizes unless others are given); its
// drafter.draft_confidence unless one is given.
DrafterOptions with_bundle_policy(const DrafterOptions& options, const Manifest& m) {
  DrafterOptions out = options;
  if (!options.drafter) {
    out.drafter = m.drafter_kind();
    if (m.drafter.lookup) {
      *out.drafter += kHybridSuffix;
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

void check_drafter_name(const std::string& spec, const std::string& own) {
  auto refuse = [&](const std::string& why) {
    return UserError("drafter '" + spec + "': " + why + "; it takes " + accepted_drafters(own));
  };
  if (is_hybrid(spec)) {
    const std::string inner = spec.substr(0, spec.size() - kHybridSuffix.size());
    if (inner == "none") throw refuse("name a model drafter before +ngram");
    return check_drafter_name(inner, own);
  }
  if (spec == "none" || spec == "ngram") return;
  if (spec == "mtp" || spec == "draft-lm") {
    if (spec != own)
      throw refuse(own == "none" || own == "ngram"
                       ? "this bundle carries no model drafter"
                       : "this bundle carries a '" + own + "' drafter (export another bundle "
                                                           "for " + spec + ")");
    return;
  }
  throw UserError("unknown drafter '" + spec + "': this bundle takes " + accepted_drafters(own));
}

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
  // The key tells apart what changes the drafter: its name, the lookup's sizes if it has one,
  // the model's confidence floor if it has one.
  const std::string& name = *chosen.drafter;
  const std::string base = is_hybrid(name) ? name.substr(0, name.size() - kHybridSuffix.size())
                                           : name;
  std::string key = name;
  if (base == "ngram" || is_hybrid(name))
    key += " n=" + std::to_string(chosen.ngram_min) + "-" + std::to_string(chosen.ngram_max);
  const std::string confidence = exact(chosen.draft_confidence);
  if (base == "mtp" || base == "draft-lm") key += " p=" + confidence;
  if (chosen.store && base != "none") key += " store";
  const auto found = drafters_.find(key);
  if (found != drafters_.end()) return found->second.get();
  if (chosen.store && base == "ngram") {  // the lookup alone: the store goes on after it
    DrafterOptions without = chosen;
    without.store = false;
    Drafter* lookup = drafter(without);
    return (drafters_[key] = std::make_unique<StoreDrafter>(lookup, &store())).get();
  }
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
    if (chosen.store) return std::make_unique<StoreDrafter>(kept.get(), &store());
    return std::make_unique<ForwardingDrafter>(kept.get());
  };
  auto made = make_drafter(name, own, chosen, model);
  Drafter* out = made.get();
  drafters_[key] = std::move(made);
  return out;
}

AnswerStore& Engine::store() {
  if (store_ == nullptr) store_ = std::make_unique<AnswerStore>();
  return *store_;
}

namespace {

// mtp_edge/request_log.py check_messages: a non-empty list of {"role", "content"} with a known
// role and text content.
void check_logged_messages(const nlohmann::json& messages, const std::string& where) {
  if (!messages.is_array() || messages.empty())
    throw UserError(where + ": \"messages\" must be a non-empty list of role/content objects");
  for (const auto& m : messages) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw UserError(where + ": every message needs a \"role\" string");
    const std::string role = m["role"];
    if (role != "system" && role != "user" && role != "assistant" && role != "tool" &&
        role != "developer")
      throw UserError(where + ": unknown role '" + role + "' (system, user or assistant)");
    if (!m.contains("content") || !m["content"].is_string())
      throw UserError(where + ": every message needs a \"content\" string");
  }
}

}  // namespace

int64_t Engine::seed_store(const std::string& log) {
  const int64_t vocab = std::min(manifest_.vocab_size, target_->vocab_size);
  int64_t added = 0;
  for (const std::string& file : log_files(log)) {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw UserError("cannot read the request log " + file);
    std::stringstream text;
    text << in.rdbuf();
    const std::string all = text.str();
    size_t start = 0;
    for (int64_t n = 1; start <= all.size(); ++n) {
      const size_t end = std::min(all.find('\n', start), all.size());
      const std::string line = all.substr(start, end - start);
      start = end + 1;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const std::string where = file + ":" + std::to_string(n);
      const nlohmann::json row = nlohmann::json::parse(line, nullptr, false);
      // A record torn by a writer killed mid-append spoils only its own line (appends start
      // on a fresh line), wherever it is: skipped, as mtp_edge/request_log.py read_log does.
      if (row.is_discarded()) continue;
      if (!row.is_object()) throw UserError(where + ": expected a JSON object");
      const nlohmann::json answer = row.value("answer_ids", nlohmann::json::array());
      bool ids = answer.is_array(), outside = false;
      for (const auto& id : answer) {
        ids = ids && id.is_number_integer();
        if (!ids) break;
        outside = outside || (id.is_number_unsigned() ? id.get<uint64_t>() >= uint64_t(vocab)
                                                      : id.get<int64_t>() < 0 ||
                                                            id.get<int64_t>() >= vocab);
      }
      if (!ids) throw UserError(where + ": \"answer_ids\" must be a list of token ids");
      const nlohmann::json messages = row.value("messages", nlohmann::json());
      check_logged_messages(messages, where);
      if (answer.empty() || outside) continue;  // nothing answered, or another model's tokens
      std::vector<int64_t> request = logged_prompt_ids(messages);
      const int64_t prompt_len = int64_t(request.size());
      for (const auto& id : answer) request.push_back(id.get<int64_t>());
      store().add(request, prompt_len);
      ++added;
    }
  }
  return added;
}

std::vector<int64_t> Engine::logged_prompt_ids(const nlohmann::json& messages) const {
  try {
    // Python's truth of the "raw" value: true, a number not 0, a non-empty text or list.
    auto truthy = [](const nlohmann::json& x) {
      if (x.is_boolean()) return x.get<bool>();
      if (x.is_number()) return x.get<double>() != 0;
      return (x.is_string() || x.is_array() || x.is_object()) && !x.empty();
    };
    if (messages.size() == 1 && messages[0].contains("raw") && truthy(messages[0]["raw"])) {
      // A prompt that came as ids whose text does not encode back to them keeps its ids
      // (mtp_edge/request_log.py raw_message); another model's ids are not this store's.
      const nlohmann::json ids = messages[0].value("token_ids", nlohmann::json());
      if (ids.is_array()) {
        const int64_t vocab = std::min(manifest_.vocab_size, target_->vocab_size);
        std::vector<int64_t> out;
        for (const auto& id : ids) {
          if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab)
            return {};
          out.push_back(id.get<int64_t>());
        }
        return out;
      }
      return encode_prompt(messages[0]["content"].get<std::string>(), /*chat=*/false);
    }
    if (!manifest_.has_chat_template || !manifest_.chat_format) return {};
    const ChatFormat& format = *manifest_.chat_format;
    // tokenizer.py check_messages: an optional system message, then user and assistant turns
    // alternating, the user's last, no user message empty.
    std::vector<std::pair<std::string, std::string>> turns;
    for (const auto& m : messages) turns.emplace_back(m["role"], m["content"]);
    std::string system;
    bool has_system = turns.front().first == "system";
    if (has_system) {
      system = turns.front().second;
      turns.erase(turns.begin());
    }
    if (turns.empty() || turns.size() % 2 == 0) return {};
    for (size_t i = 0; i < turns.size(); ++i) {
      if (turns[i].first != (i % 2 == 0 ? "user" : "assistant")) return {};
      if (i % 2 == 0 && turns[i].second.find_first_not_of(" \t\n\r\f\v") == std::string::npos)
        return {};
    }
    if (has_system && !format.system_prefix) {  // tokenizer.py template_messages folds it
      if (!system.empty()) turns[0].second = system + "\n\n" + turns[0].second;
      has_system = false;
    }
    if (turns.size() > 1 && !format.next_turn) return {};  // one turn only: not rendered here
    // The rendered conversation as pieces, template and text alternately (encode_chat).
    std::vector<std::string> pieces;
    if (has_system)
      pieces = {*format.system_prefix, system, *format.system_suffix};
    else
      pieces = {format.prefix};
    pieces.push_back(turns[0].second);
    for (size_t i = 1; i < turns.size(); i += 2) {
      pieces.push_back(format.suffix);
      pieces.push_back(turns[i].second);
      pieces.push_back(*format.next_turn);
      pieces.push_back(turns[i + 1].second);
    }
    pieces.push_back(format.suffix);
    std::vector<int64_t> ids = encode_chat(pieces);
    if (manifest_.add_bos && (ids.empty() || ids[0] != *manifest_.bos_id))
      ids.insert(ids.begin(), *manifest_.bos_id);
    return ids;
  } catch (const UserError&) {
    return {};
  }
}

void Engine::check_k(int64_t k) const {
  if (k < 0 || k + 1 > target_->max_chunk)
    throw UserError("--k must be in 0.." + std::to_string(target_->max_chunk - 1) +
                    " (k drafts and the pending token go in one call of at most " +
                    std::to_string(target_->max_chunk) + " tokens), got " + std::to_string(k));
}

void check_token_ids(const std::vector<int64_t>& ids, int64_t vocab_size) {
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab_size)
      throw UserError("token id " + std::to_string(ids[i]) + " (at index " + std::to_string(i) +
                      ") is not in the vocabulary: ids must be in 0.." +
                      std::to_string(vocab_size - 1));
}

void Engine::check_token_ids(const std::vector<int64_t>& ids) const {
  mtp::check_token_ids(ids, std::min(manifest_.vocab_size, target_->vocab_size));
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
  std::vector<int64_t> ids;
  if (chat && manifest_.has_chat_template) {  // no template: the text as it is, as in Python
    if (!manifest_.chat_format)
      throw UserError("bundle " + manifest_.dir +
                      " has no chat_format for the native runtime: re-export it with this "
                      "mtp-export, or feed raw text (--no-chat-template)");
    ids = encode_chat({manifest_.chat_format->prefix, text, manifest_.chat_format->suffix});
  } else {
    for (int32_t id : tokenizer_->encode(text, /*parse_special=*/false)) ids.push_back(id);
  }
  if (manifest_.add_bos && (ids.empty() || ids[0] != *manifest_.bos_id))
    ids.insert(ids.begin(), *manifest_.bos_id);
  return ids;
#else
  (void)text, (void)chat;
  throw UserError("this build of the native runtime has no tokenizer: give prompt_ids");
#endif
}

std::vector<int64_t> Engine::encode_chat(const std::vector<std::string>& pieces) const {
#ifdef MTP_HAVE_TOKENIZER
  if (!tokenizer_) throw UserError("bundle " + manifest_.dir + " has no tokenizer.json");
  // Special tokens typed in a text are text, the template's own markers stay special
  // (mtp_edge/tokenizer.py encode_prompt): what a user types cannot end its turn.
  std::vector<size_t> holding;  // the texts (odd pieces) that hold special tokens' text
  for (size_t i = 1; i < pieces.size(); i += 2)
    if (tokenizer_->holds_special(pieces[i])) holding.push_back(i);
  auto joined = [&](size_t from, size_t to) {
    std::string text;
    for (size_t i = from; i < std::min(to, pieces.size()); ++i) text += pieces[i];
    return text;
  };
  std::vector<int32_t> encoded;
  if (holding.empty()) {
    encoded = tokenizer_->encode(joined(0, pieces.size()));
  } else if (holding.size() == 1) {
    const size_t at = holding[0];
    encoded = tokenizer_->encode_framed(joined(0, at), pieces[at], joined(at + 1, pieces.size()));
  } else {
    for (size_t i = 1; i < pieces.size(); i += 2)
      for (int32_t id : tokenizer_->encode_framed(pieces[i - 1], pieces[i], ""))
        encoded.push_back(id);
    if (pieces.size() % 2 == 1)
      for (int32_t id : tokenizer_->encode(pieces.back())) encoded.push_back(id);
  }
  return {encoded.begin(), encoded.end()};
#else
  (void)pieces;
  throw UserError("this build of the native runtime has no tokenizer");
#endif
}

GenerationResult Engine::generate(const std::vector<int64_t>& prompt, Drafter* drafter,
                                  const GenerationConfig& config, const OnToken& on_token,
                                  bool reuse_cache) {
  check_token_ids(prompt);
  size_t shared = 0;
  if (reuse_cache)
    while (shared < std::min(cached_.size(), prompt.size()) && cached_[shared] == prompt[shared])
      ++shared;
  cached_.clear();  // unknown should the call fail half-way
  auto detokenize = [this](const std::vector<int64_t>& ids) { return decode(ids); };
  GenerationConfig with_costs = config;
  if (with_costs.costs == nullptr) with_costs.costs = &costs_;
  GenerationResult result = mtp::generate(*target_, prompt, drafter, with_costs, detokenize,
                                          on_token, int64_t(shared));
  cached_ = result.cached_tokens;
  return result;
}

Conversation::Conversation(Engine& engine, std::string system_prompt)
    : engine_(engine), system_prompt_(std::move(system_prompt)) {
  const Manifest& m = engine.manifest();
  if (!m.has_chat_template || !m.chat_format)
    throw UserError("bundle " + m.dir +
                    " has no chat format, which a conversation needs: re-export it with this "
                    "mtp-export, or generate from raw text");
  format_ = &*m.chat_format;
  if (!system_prompt_.empty() && !format_->system_prefix)
    throw UserError("this bundle's chat template takes no system prompt (or not as a piece "
                    "of text before the first turn): start the conversation without one");
}

void Conversation::add_user(const std::string& text) {
  if (awaiting_answer_)
    throw UserError("the last user turn has no answer yet: generate it before adding another");
  std::vector<int64_t> turn;
  if (tokens_.empty()) {
    turn = system_prompt_.empty()
               ? engine_.encode_chat({format_->prefix, text, format_->suffix})
               : engine_.encode_chat({*format_->system_prefix, system_prompt_,
                                      *format_->system_suffix, text, format_->suffix});
    const Manifest& m = engine_.manifest();
    if (m.add_bos && (turn.empty() || turn[0] != *m.bos_id)) turn.insert(turn.begin(), *m.bos_id);
  } else {
    if (!format_->next_turn)
      throw UserError("this bundle's chat format holds one turn (exported before multi-turn "
                      "chat, or its template does not render turns by concatenation): "
                      "re-export it with this mtp-export, or reset the conversation");
    turn = engine_.encode_chat({*format_->next_turn, text, format_->suffix});
  }
  const size_t total = tokens_.size() + turn.size();
  const int64_t context = engine_.manifest().max_seq_len;
  if (int64_t(total) >= context)
    throw ContextFull("context full: the conversation would hold " + std::to_string(total) +
                      " tokens and the context holds " + std::to_string(context) +
                      ": reset the conversation");
  tokens_.insert(tokens_.end(), turn.begin(), turn.end());
  awaiting_answer_ = true;
}

Conversation::Answer Conversation::answer(Drafter* drafter, const GenerationConfig& config,
                                          const OnToken& on_token, bool reuse_cache) {
  if (!awaiting_answer_) throw UserError("there is no user turn to answer: add one first");
  Answer answer;
  answer.prompt_tokens = int64_t(tokens_.size());
  answer.generation = engine_.generate(tokens_, drafter, config, on_token, reuse_cache);
  const auto& ids = answer.generation.token_ids;
  tokens_.insert(tokens_.end(), ids.begin(), ids.end());
  awaiting_answer_ = false;
  return answer;
}

void Conversation::reset() {
  tokens_.clear();
  awaiting_answer_ = false;
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
      {"drafted_steps", s.drafted_steps},
      {"fallback_steps", s.fallback_steps},
      {"accepted_tokens", s.accepted_tokens},
      {"draft_ms", rounded(s.draft_seconds * 1e3, 3)},
      {"verify_ms", rounded(s.verify_seconds * 1e3, 3)},
  };
}

nlohmann::json store_json(const AnswerStore& store) {
  return {{"store_tokens", store.tokens()},
          {"store_requests", store.requests()},
          {"store_drafts", store.drafts()}};
}

}  // namespace mtp
