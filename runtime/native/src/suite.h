// The measurement behind mtp-runner: plain vs speculative decoding of each prompt on the same
// program, reported in exactly the mtp-bench JSON format (devices/harness.py: run_suite).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine.h"

namespace mtp {

constexpr double kNearTie = 0.02;  // devices/harness.py NEAR_TIE

struct Prompt {
  std::string id, category, text;
  int64_t max_new_tokens = 128;
  std::vector<int64_t> ids;  // pre-tokenized ("prompt_ids"): used as is, no chat format
};

// {"id", "category", "prompt" and/or "prompt_ids", "max_new_tokens"} per line.
std::vector<Prompt> load_prompts(const std::string& path);

struct SuiteOptions {
  int64_t max_new_tokens = 0;  // 0: each prompt's own
  int repeat = 1;
  bool chat = true;
  // Each row also gets "spec_drafts": the tokens the drafter proposed at each verify step of the
  // last speculative run (what the target verified), to compare drafters step by step, and
  // "spec_steps": per verify step, [tokens drafted, tokens accepted].
  bool record_drafts = false;
  GenerationConfig config;  // k, adaptive_k, fallback, sampling, eos_ids, stop_strings
  // The store of past requests the engine's drafter drafts from (EngineOptions::store): each
  // prompt's ids and speculative answer go into it after the prompt's last repeat, so that
  // every repeat of a prompt drafts from the same store and later prompts from the earlier
  // ones. Null: no store.
  AnswerStore* store = nullptr;
};

// The report body: summary, per_category, prompts (each row also carries ar_token_ids and
// spec_token_ids, the generated ids of the last repeat, spec_drafts if asked for, and with a
// store store_extended, the drafts of the last speculative run the store extended).
nlohmann::json run_suite(Engine& engine, const std::vector<Prompt>& prompts,
                         const SuiteOptions& options,
                         const std::function<void(const std::string&)>& progress);

double median(std::vector<double> values);

}  // namespace mtp
