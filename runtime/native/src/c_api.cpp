// The C API over Engine and Conversation: exceptions become messages, never cross the C
// boundary.
#include "mtp_edge.h"

#include <cstring>
#include <string>
#include <tuple>

#include "engine.h"
#include "errors.h"
#include "request_log.h"

struct mtp_engine {
  std::unique_ptr<mtp::Engine> engine;
  std::unique_ptr<mtp::RequestLog> log;  // mtp_request_log's: every answered request goes in
};

struct mtp_chat {
  mtp_engine* owner;
  mtp::Engine* engine;
  mtp::Conversation conversation;
  std::string last_result;  // the last answer's result JSON, for mtp_chat_last_stats
  // The conversation as text, as a request log keeps it: the system prompt (when one was
  // given), then the user's and the answers' turns.
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
};

namespace {

void copy_out(const std::string& text, char* out, size_t len) {
  if (out == nullptr || len == 0) return;
  const size_t n = std::min(text.size(), len - 1);
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

// A piece of text is complete unless it ends inside a UTF-8 character (U+FFFD from decode).
bool ends_mid_character(const std::string& text) {
  return text.size() >= 3 && text.compare(text.size() - 3, 3, "\xEF\xBF\xBD") == 0;
}

// What options_json sets for one generation (mtp_edge.h lists the keys).
struct Settings {
  mtp::GenerationConfig config;
  mtp::Drafter* drafter = nullptr;
  bool chat = true;
  bool reuse_cache = true;
  bool store = false;  // draft also from the engine's past requests, and add this one
};

Settings parse_settings(mtp::Engine& engine, const char* options_json) {
  nlohmann::json options = nlohmann::json::object();
  if (options_json != nullptr && *options_json != '\0') {
    options = nlohmann::json::parse(options_json, nullptr, false);
    if (options.is_discarded() || !options.is_object())
      throw mtp::UserError("options_json is not a JSON object");
  }
  Settings settings;
  mtp::GenerationConfig& config = settings.config;
  config.max_new_tokens = options.value("max_new_tokens", int64_t(128));
  config.k = options.value("k", engine.manifest().k_for_this_cpu());
  engine.check_k(config.k);
  config.sampling.temperature = options.value("temperature", 0.0);
  config.sampling.top_k = options.value("top_k", 0);
  config.sampling.top_p = options.value("top_p", 1.0);
  config.sampling.seed = options.value("seed", uint64_t(0));
  config.eos_ids = engine.manifest().eos_ids;
  if (options.contains("stop_strings")) {
    const nlohmann::json& stops = options["stop_strings"];
    if (!stops.is_array()) throw mtp::UserError("stop_strings must be a list of texts");
    for (const auto& s : stops) {
      if (!s.is_string() || s.get<std::string>().empty())
        throw mtp::UserError("stop_strings must be a list of non-empty texts");
      config.stop_strings.push_back(s.get<std::string>());
    }
  }
  if (!(config.sampling.temperature >= 0)) throw mtp::UserError("temperature must be >= 0");
  if (!(config.sampling.top_p > 0 && config.sampling.top_p <= 1))
    throw mtp::UserError("top_p must be in (0, 1]");
  if (options.contains("fallback")) {
    if (!options["fallback"].is_boolean())
      throw mtp::UserError("fallback must be true or false");
    config.fallback = options["fallback"].get<bool>();
  }
  if (options.contains("store")) {
    if (!options["store"].is_boolean()) throw mtp::UserError("store must be true or false");
    settings.store = options["store"].get<bool>();
  }
  settings.chat = options.value("chat", true);
  settings.reuse_cache = options.value("reuse_cache", true);
  const bool speculative = options.value("speculative", true);
  // No "drafter", "ngram_sizes" or "draft_confidence": the drafter the engine was opened
  // with (the bundle's own, with its policy). "speculative": false: none, whatever they say.
  mtp::DrafterOptions choice;
  bool chosen = false;
  if (options.contains("drafter")) {
    if (!options["drafter"].is_string())
      throw mtp::UserError("drafter must be a text such as \"mtp\" or \"ngram\"");
    choice.drafter = options["drafter"].get<std::string>();
    chosen = true;
  }
  if (options.contains("ngram_sizes")) {
    if (!options["ngram_sizes"].is_string())
      throw mtp::UserError("ngram_sizes must be a text MIN-MAX such as \"1-3\"");
    std::tie(choice.ngram_min, choice.ngram_max) =
        mtp::parse_ngram_sizes(options["ngram_sizes"].get<std::string>(), "ngram_sizes");
    choice.ngram_sizes_given = chosen = true;
  }
  if (options.contains("draft_confidence")) {
    const nlohmann::json& p = options["draft_confidence"];
    if (!p.is_number() || !(p.get<double>() >= 0 && p.get<double>() < 1))
      throw mtp::UserError("draft_confidence must be a number in [0, 1)");
    choice.draft_confidence = p.get<double>();
    choice.draft_confidence_given = chosen = true;
  }
  // "store": the same drafter with its model drafter extended by the engine's store (kept
  // beside the plain one, built on first use).
  choice.store = settings.store;
  if (speculative)
    settings.drafter = chosen || settings.store ? engine.drafter(choice) : engine.drafter();
  return settings;
}

// A generation's request (prompt and answer) into the engine's store when the options ask for
// it, and the store's numbers into its result: store_extended, the drafts of this generation
// the store extended (its drafts since `drafts_before`).
void add_to_store(mtp::Engine& engine, const Settings& settings, int64_t drafts_before,
                  const std::vector<int64_t>& request, int64_t prompt_len, nlohmann::json& out) {
  if (!settings.store) return;
  mtp::AnswerStore& store = engine.store();
  store.add(request, prompt_len);
  out.update(mtp::store_json(store));
  out["store_extended"] = store.drafts() - drafts_before;
}

// A generation's request into the engine's request log, when mtp_request_log set one. A log
// that cannot be written does not take the answer away: "log_error" in its result says why.
void add_to_log(mtp_engine& handle, const nlohmann::ordered_json& messages,
                const mtp::GenerationResult& result, nlohmann::json& out) {
  if (!handle.log) return;
  try {
    handle.log->append(messages, result.token_ids, result.stats.tau(), result.stop_reason,
                       handle.engine->manifest().model_name);
  } catch (const std::exception& e) {
    out["log_error"] = e.what();
  }
}

nlohmann::ordered_json system_messages(const std::string& system_prompt) {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  if (!system_prompt.empty()) messages.push_back({{"role", "system"}, {"content", system_prompt}});
  return messages;
}

// Passes each token on with the text it completes: whole UTF-8 characters only, so a token
// that ends inside a character brings "" and its bytes come with a later token.
class TextStream {
 public:
  explicit TextStream(const mtp::Engine& engine) : engine_(engine) {}
  std::string next(int64_t token) {
    streamed_.push_back(token);
    const std::string text = engine_.decode(streamed_);
    if (ends_mid_character(text) || text.size() <= printed_) return {};
    std::string piece = text.substr(printed_);
    printed_ = text.size();
    return piece;
  }

 private:
  const mtp::Engine& engine_;
  std::vector<int64_t> streamed_;
  size_t printed_ = 0;
};

// As mtp-run: the text ends before the first stop string (the streamed pieces, sent as tokens
// came, include it).
std::string answer_text(const mtp::Engine& engine, const mtp::GenerationResult& result,
                        const mtp::GenerationConfig& config) {
  std::string text = engine.decode(result.token_ids);
  for (const std::string& s : config.stop_strings) {
    const size_t at = text.find(s);
    if (at != std::string::npos) text.resize(at);
  }
  return text;
}

std::string dump(const nlohmann::json& out) {
  return out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void write_result(const std::string& dumped, char* out, size_t len) {
  if (out != nullptr && dumped.size() >= len)
    throw mtp::UserError("result buffer too small: need " + std::to_string(dumped.size() + 1));
  copy_out(dumped, out, len);
}

}  // namespace

extern "C" mtp_engine* mtp_open(const char* bundle_dir, char* err, size_t err_len) {
  try {
    auto handle = std::make_unique<mtp_engine>();
    handle->engine = std::make_unique<mtp::Engine>(bundle_dir, mtp::EngineOptions{});
    return handle.release();
  } catch (const std::exception& e) {
    copy_out(e.what(), err, err_len);
    return nullptr;
  }
}

extern "C" void mtp_close(mtp_engine* engine) { delete engine; }

extern "C" int mtp_generate(mtp_engine* handle, const char* prompt, const char* options_json,
                            mtp_on_text on_text, void* user, char* stats_json, size_t stats_len,
                            char* err, size_t err_len) {
  try {
    if (handle == nullptr || prompt == nullptr) throw mtp::UserError("no engine or no prompt");
    mtp::Engine& engine = *handle->engine;
    const Settings settings = parse_settings(engine, options_json);
    const auto ids = engine.encode_prompt(prompt, settings.chat);
    TextStream stream(engine);
    auto on_token = [&](int64_t token) {
      if (on_text == nullptr) return true;
      const std::string piece = stream.next(token);
      if (!piece.empty()) on_text(piece.c_str(), user);
      return true;
    };
    // A prompt of its own: prefilled whole, as mtp-run does.
    const int64_t drafts_before = settings.store ? engine.store().drafts() : 0;
    const mtp::GenerationResult result =
        engine.generate(ids, settings.drafter, settings.config, on_token, false);
    nlohmann::json out = {{"text", answer_text(engine, result, settings.config)},
                          {"stop_reason", result.stop_reason},
                          {"token_ids", result.token_ids},
                          {"prompt_tokens", ids.size()},
                          {"drafter", settings.drafter ? settings.drafter->name() : "none"},
                          {"stats", mtp::stats_json(result.stats)}};
    std::vector<int64_t> request = ids;  // the prompt and its answer, for the store
    request.insert(request.end(), result.token_ids.begin(), result.token_ids.end());
    add_to_store(engine, settings, drafts_before, request, int64_t(ids.size()), out);
    // As mtp_edge/api.py logs a prompt: one user message, marked raw without the chat format.
    nlohmann::ordered_json message = {{"role", "user"}, {"content", prompt}};
    if (!settings.chat) message["raw"] = true;
    add_to_log(*handle, nlohmann::ordered_json::array({message}), result, out);
    write_result(dump(out), stats_json, stats_len);
    return MTP_OK;
  } catch (const std::exception& e) {
    copy_out(e.what(), err, err_len);
    return MTP_ERROR;
  }
}

extern "C" mtp_chat* mtp_chat_create(mtp_engine* engine, const char* system_prompt, char* err,
                                     size_t err_len) {
  try {
    if (engine == nullptr) throw mtp::UserError("no engine");
    const std::string system = system_prompt ? system_prompt : "";
    return new mtp_chat{engine, engine->engine.get(), mtp::Conversation(*engine->engine, system),
                        {}, system_messages(system)};
  } catch (const std::exception& e) {
    copy_out(e.what(), err, err_len);
    return nullptr;
  }
}

extern "C" void mtp_chat_free(mtp_chat* chat) { delete chat; }

extern "C" void mtp_chat_reset(mtp_chat* chat) {
  if (chat == nullptr) return;
  chat->conversation.reset();
  chat->last_result.clear();
  nlohmann::ordered_json kept = nlohmann::ordered_json::array();
  for (const auto& m : chat->messages)
    if (m["role"] == "system") kept.push_back(m);
  chat->messages = kept;
}

extern "C" int mtp_chat_add_user(mtp_chat* chat, const char* text, char* err, size_t err_len) {
  try {
    if (chat == nullptr || text == nullptr) throw mtp::UserError("no conversation or no text");
    chat->conversation.add_user(text);
    chat->messages.push_back({{"role", "user"}, {"content", text}});
    return MTP_OK;
  } catch (const mtp::ContextFull& e) {
    copy_out(e.what(), err, err_len);
    return MTP_CONTEXT_FULL;
  } catch (const std::exception& e) {
    copy_out(e.what(), err, err_len);
    return MTP_ERROR;
  }
}

extern "C" int mtp_chat_generate(mtp_chat* chat, const char* options_json, mtp_on_token on_token,
                                 void* user, char* result_json, size_t result_len, char* err,
                                 size_t err_len) {
  try {
    if (chat == nullptr) throw mtp::UserError("no conversation");
    mtp::Engine& engine = *chat->engine;
    const Settings settings = parse_settings(engine, options_json);
    TextStream stream(engine);
    auto each_token = [&](int64_t token) {
      if (on_token == nullptr) return true;
      const std::string piece = stream.next(token);
      return on_token(int32_t(token), piece.c_str(), user) == MTP_CONTINUE;
    };
    const int64_t drafts_before = settings.store ? engine.store().drafts() : 0;
    const mtp::Conversation::Answer answer = chat->conversation.answer(
        settings.drafter, settings.config, each_token, settings.reuse_cache);
    const mtp::GenerationResult& result = answer.generation;
    nlohmann::json out = {
        {"text", answer_text(engine, result, settings.config)},
        {"stop_reason", result.stop_reason},
        {"token_ids", result.token_ids},
        {"drafter", settings.drafter ? settings.drafter->name() : "none"},
        {"prompt_tokens", answer.prompt_tokens},
        {"reused_tokens", result.reused_tokens},
        {"prefilled_tokens", answer.prompt_tokens - result.reused_tokens},
        {"cached_tokens", result.cached_tokens.size()},
        {"context_tokens", chat->conversation.tokens().size()},
        {"max_seq_len", engine.manifest().max_seq_len},
        {"stats", mtp::stats_json(result.stats)}};
    // The conversation so far (this turn's prompt) and the answer: one request for the store.
    add_to_store(engine, settings, drafts_before, chat->conversation.tokens(),
                 int64_t(answer.prompt_tokens), out);
    add_to_log(*chat->owner, chat->messages, result, out);
    chat->messages.push_back({{"role", "assistant"}, {"content", engine.decode(result.token_ids)}});
    chat->last_result = dump(out);
    write_result(chat->last_result, result_json, result_len);
    return MTP_OK;
  } catch (const std::exception& e) {
    copy_out(e.what(), err, err_len);
    return MTP_ERROR;
  }
}

extern "C" int mtp_chat_last_stats(const mtp_chat* chat, char* result_json, size_t result_len,
                                   char* err, size_t err_len) {
  try {
    if (chat == nullptr || chat->last_result.empty())
      throw mtp::UserError("no answer yet in this conversation");
    write_result(chat->last_result, result_json, result_len);
    return MTP_OK;
  } catch (const std::exception& e) {
    copy_out(e.what(), err, err_len);
    return MTP_ERROR;
  }
}

extern "C" int mtp_request_log(mtp_engine* handle, const char* dir, const char* options_json,
                               char* result_json, size_t result_len, char* err,
                               size_t err_len) {
  try {
    if (handle == nullptr) throw mtp::UserError("no engine");
    nlohmann::json options = nlohmann::json::object();
    if (options_json != nullptr && *options_json != '\0') {
      options = nlohmann::json::parse(options_json, nullptr, false);
      if (options.is_discarded() || !options.is_object())
        throw mtp::UserError("options_json is not a JSON object");
    }
    for (const auto& [key, value] : options.items()) {
      if (key == "seed_store") {
        if (!value.is_boolean()) throw mtp::UserError("seed_store must be true or false");
      } else if (key == "file_bytes" || key == "keep") {
        if (!value.is_number_integer())
          throw mtp::UserError(key + " must be a whole number");
      } else {
        throw mtp::UserError("unknown request log option '" + key +
                             "' (file_bytes, keep, seed_store)");
      }
    }
    nlohmann::json out = {{"log", nullptr}};
    if (dir == nullptr || *dir == '\0') {  // logging stops; what was written stays
      handle->log.reset();
      write_result(dump(out), result_json, result_len);
      return MTP_OK;
    }
    auto log = std::make_unique<mtp::RequestLog>(
        dir, options.value("file_bytes", mtp::RequestLog::kFileBytes),
        options.value("keep", mtp::RequestLog::kKeep));
    out["log"] = log->directory();
    out["seeded_requests"] = 0;
    if (options.value("seed_store", true)) {
      mtp::Engine& engine = *handle->engine;
      out["seeded_requests"] = engine.seed_store(log->directory());
      out.update(mtp::store_json(engine.store()));
    }
    handle->log = std::move(log);
    write_result(dump(out), result_json, result_len);
    return MTP_OK;
  } catch (const std::exception& e) {
    copy_out(e.what(), err, err_len);
    return MTP_ERROR;
  }
}
