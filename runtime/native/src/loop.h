// The speculative decoding loop: runtime/loop.py in C++, step for step.
//
// Prefill in chunks; then repeat {draft k (or as many as pay, with the fallback); verify k+1 in
// one target call; accept the longest agreeing prefix (greedy) or by rejection sampling;
// advance} until eos, a stop string, max tokens or a full context; then the drafter observes
// the last verified rows (a self head's cache takes them in for a conversation's next turn).
// The drafter is asked at every step, for 0 tokens too (so that a drafter keeping state takes
// in the rows). Plain decoding is the same loop with no drafter. Invariant between
// steps: `context` holds every token so far; the target's cache holds all of them but the last,
// which the next call feeds (with the drafts behind it) at position `pos`.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "drafters.h"
#include "fallback.h"
#include "model.h"
#include "sampling.h"

namespace mtp {

struct GenerationConfig {
  int64_t max_new_tokens = 128;
  int64_t k = 4;            // most tokens drafted per step
  bool adaptive_k = false;  // grow k by 2 after a fully accepted step, shrink by 1 otherwise
  // Draft per step only as many tokens (0..k) as measured acceptance and costs say pay
  // (fallback.h). true: always; empty: when greedy (its choices follow timings, so sampling
  // with it gives other samples from run to run for one seed); false: never.
  std::optional<bool> fallback = false;
  // The target's costs measured so far, which the fallback reads and adds to (Engine keeps
  // one per target); null: this generation's own, measured from nothing.
  StepCosts* costs = nullptr;
  // Fixed costs reported to the fallback instead of the timings (same decisions run after run).
  std::optional<CostModel> cost_model;
  SamplingParams sampling;
  std::vector<int64_t> eos_ids;
  // Stop as soon as the text of the generated tokens contains one of these (checked after each
  // token, on the detokenized last kStopTailTokens tokens); the token completing it is kept.
  std::vector<std::string> stop_strings;
};

// How many generated tokens the stop-string check detokenizes (runtime/loop.py's window).
constexpr size_t kStopTailTokens = 64;

// Token ids -> text (special tokens skipped), for stop strings.
using Detokenize = std::function<std::string(const std::vector<int64_t>&)>;

struct GenerationStats {
  int64_t generated_tokens = 0;
  int64_t verify_steps = 0;  // target calls after prefill
  int64_t drafted_tokens = 0;
  int64_t drafted_steps = 0;   // verify steps that carried at least one drafted token
  int64_t fallback_steps = 0;  // steps the fallback drafted nothing for, as drafting did not pay
  int64_t accepted_tokens = 0;
  std::vector<int64_t> accepted_per_position;  // steps that kept draft i
  std::vector<int64_t> drafted_per_position;   // steps that drafted i
  double ttft_ms = 0, decode_seconds = 0, draft_seconds = 0, verify_seconds = 0;

  // Tokens emitted per verify step, the bonus token included (1.0 for plain decoding).
  double tau() const;
  double acceptance_rate() const;
  double decode_tokens_per_s() const;
};

struct GenerationResult {
  std::vector<int64_t> token_ids;  // an eos token that stopped generation is left out
  std::string stop_reason;  // eos | stop_string | max_tokens | context_full | stopped
  GenerationStats stats;
  int64_t reused_tokens = 0;  // prompt tokens not prefilled: the cache held them already
  // The tokens whose K/V the target's cache now holds, from position 0 (every token of the
  // context but the last): what a later call may pass back as its cached prefix.
  std::vector<int64_t> cached_tokens;
  std::vector<double> top2_gaps;  // the target's best-minus-second logit where each was chosen
  // Per verify step, (tokens drafted and verified, tokens of them accepted).
  std::vector<std::pair<int64_t, int64_t>> step_counts;
};

// Sees each emitted token (for streaming); returning false stops generation there (stop_reason
// "stopped": a stop button), the token kept.
using OnToken = std::function<bool(int64_t)>;

// Throws UserError for an empty prompt or one that fills the context. `detokenize` is needed
// for stop strings (std::invalid_argument without it). cached_prefix: how many leading prompt
// tokens the target's cache already holds (a conversation's earlier turns); only the rest is
// prefilled, at least the last token, and a drafter that reads hidden states sees the rows of
// what was prefilled.
GenerationResult generate(Model& target, const std::vector<int64_t>& prompt, Drafter* drafter,
                          const GenerationConfig& config, const Detokenize& detokenize = nullptr,
                          const OnToken& on_token = nullptr, int64_t cached_prefix = 0);

// Index of the first token where two outputs differ, or -1 when identical.
int64_t first_divergence(const std::vector<int64_t>& plain, const std::vector<int64_t>& spec);

}  // namespace mtp
