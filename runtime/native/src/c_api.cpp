// The C API over Engine: exceptions become messages, never cross the C boundary.
#include "mtp_edge.h"

#include <cstring>
#include <string>
#include <tuple>

#include "engine.h"
#include "errors.h"

struct mtp_engine {
  std::unique_ptr<mtp::Engine> engine;
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

}  // namespace

extern "C" mtp_engine* mtp_open(const char* bundle_dir, char* err, size_t err_len) {
  try {
    auto handle = new mtp_engine;
    handle->engine = std::make_unique<mtp::Engine>(bundle_dir, mtp::EngineOptions{});
    return handle;
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
    nlohmann::json options = nlohmann::json::object();
    if (options_json != nullptr && *options_json != '\0') {
      options = nlohmann::json::parse(options_json, nullptr, false);
      if (options.is_discarded() || !options.is_object())
        throw mtp::UserError("options_json is not a JSON object");
    }
    mtp::GenerationConfig config;
    config.max_new_tokens = options.value("max_new_tokens", int64_t(128));
    config.k = options.value("k", int64_t(engine.manifest().default_k()));
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
    mtp::Drafter* drafter = nullptr;
    if (speculative) drafter = chosen ? engine.drafter(choice) : engine.drafter();
    const auto ids = engine.encode_prompt(prompt, options.value("chat", true));

    std::vector<int64_t> streamed;
    size_t printed = 0;
    auto stream = [&](int64_t token) {
      if (on_text == nullptr) return;
      streamed.push_back(token);
      const std::string text = engine.decode(streamed);
      if (!ends_mid_character(text) && text.size() > printed) {
        on_text(text.c_str() + printed, user);
        printed = text.size();
      }
    };
    auto detokenize = [&engine](const std::vector<int64_t>& t) { return engine.decode(t); };
    mtp::GenerationResult result =
        mtp::generate(engine.target(), ids, drafter, config, detokenize, stream);
    // As mtp-run: the text ends before the first stop string (the streamed pieces, sent as
    // tokens came, include it).
    std::string text = engine.decode(result.token_ids);
    for (const std::string& s : config.stop_strings) {
      const size_t at = text.find(s);
      if (at != std::string::npos) text.resize(at);
    }
    nlohmann::json out = {{"text", text},
                          {"stop_reason", result.stop_reason},
                          {"token_ids", result.token_ids},
                          {"prompt_tokens", ids.size()},
                          {"drafter", drafter != nullptr ? drafter->name() : "none"},
                          {"stats", mtp::stats_json(result.stats)}};
    const std::string dumped =
        out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (stats_json != nullptr && dumped.size() >= stats_len)
      throw mtp::UserError("stats_json buffer too small: need " +
                           std::to_string(dumped.size() + 1));
    copy_out(dumped, stats_json, stats_len);
    return 0;
  } catch (const std::exception& e) {
    copy_out(e.what(), err, err_len);
    return 1;
  }
}
