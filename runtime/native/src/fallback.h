// The online fallback: runtime/fallback.py in C++, decision for decision.
//
// Each step drafts the number of tokens that pays best, none when none pays. A step that drafts
// n tokens emits 1 + sum_{i<=n} prod_{j<=i} a_j tokens on average (a_j: the chance that draft
// position j is kept once the ones before it were) and costs verify(n + 1) + n * draft. Both are
// measured while generating: acceptance per position and per draft source as an exponentially
// weighted average, costs from the loop's timings of its calls (per width, the median of the
// last few). While it does not draft, a "shadow" draft is proposed, never verified, and compared
// with the tokens the target then emits, so that it learns when drafting pays again. Only how
// many tokens are drafted changes, never how the target's tokens are chosen.
//
// The decisions are a function of the costs the loop reports: given the same reported costs
// (CostModel: fixed costs in place of timings) both runtimes draft the same counts, step by step.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace mtp {

constexpr double kAcceptanceWeight = 0.15;  // weight of the newest step in acceptance averages
constexpr double kCostWeight = 0.2;         // weight of the newest timing in draft cost averages
constexpr size_t kRecentCalls = 7;     // a width's cost: the median of its last calls
constexpr size_t kTrustedCalls = 3;    // calls of a width before their median stands alone
constexpr double kPriorAcceptance = 0.5;   // the first position's, before a verified draft
constexpr double kPriorVerifySlope = 0.1;  // verify(T) ~ verify(1) (1 + slope (T - 1))
constexpr double kOutlier = 3.0;       // a draft timing counts as at most this multiple of its mean
constexpr double kCheapShadow = 0.02;  // shadow every plain step when k drafts cost < 2% of one
constexpr int64_t kFirstProbeInterval = 2, kMaxProbeInterval = 8;  // plain steps between shadows
constexpr int64_t kRemeasurePlainAfter = 100;  // drafted steps before one plain step re-measures

// Seconds per target call of each width, and per requested draft token of each draft source, as
// measured. They belong to the target (backend, model, machine): kept across generations.
struct StepCosts {
  std::map<int64_t, std::deque<double>> verify;  // width -> seconds of its last calls
  std::map<int64_t, double> measured;            // width -> their median
  std::map<std::string, double> draft;           // draft source -> seconds per requested token
  int64_t steps_since_plain = 0;                 // drafted steps since the last plain one

  void record_verify(int64_t width, double seconds);
  void record_draft(const std::string& source, int64_t requested, double seconds);
  // The median of the width's recent calls once there are kTrustedCalls of them; else what the
  // trusted widths say (interpolated, or scaled by the prior slope) where that is lower, never
  // above a trusted wider call's. Empty before any call was measured.
  std::optional<double> verify_seconds(int64_t width) const;
};

// Fixed costs reported in place of the loop's timings, so that decisions do not follow the
// machine's load: a target call of width w costs verify_ms * (1 + slope * (w - 1)), a requested
// draft token draft_ms from a model drafter and nothing from a prompt lookup ("ngram",
// "lookup"). For comparing runs and runtimes; generation measures by default.
struct CostModel {
  double verify_ms = 0, slope = 0, draft_ms = 0;
  double verify_seconds(int64_t width) const;
  double draft_seconds(const std::string& source, int64_t requested) const;
};

// Chooses each step's draft length. The loop asks plan(k, context) before drafting, reports
// each verified step with record_step, and hands every context it extends to check_shadow.
class Fallback {
 public:
  using SourceOf = std::function<std::string(const std::vector<int64_t>&)>;
  Fallback(int64_t k_max, StepCosts& costs, SourceOf source_of);

  // Per position, the chance a draft token is kept once the ones before it were; a position
  // not seen yet in this generation is taken to be like the one before it.
  std::vector<double> acceptance(const std::string& source) const;
  // The draft length n in 0..k with the most expected tokens per second.
  int64_t best_k(int64_t k, const std::string& source) const;
  struct Plan {
    int64_t draft = 0;    // tokens to draft and verify
    bool shadow = false;  // whether to draft k more as a shadow only
  };
  Plan plan(int64_t k, const std::vector<int64_t>& context);
  // A verified step: `requested` tokens asked of the drafter (a shadow's included), `drafted`
  // of them verified, `accepted` kept.
  void record_step(int64_t requested, int64_t drafted, int64_t accepted, double draft_seconds,
                   double verify_seconds);
  // A draft for the context's indices start.. that the target will not verify.
  void start_shadow(std::vector<int64_t> tokens, int64_t start);
  // Compares the pending shadow draft with the tokens the target has emitted since.
  void check_shadow(const std::vector<int64_t>& context);
  const std::string& source() const { return source_; }

 private:
  bool wants_shadow(int64_t k);
  void observe(const std::string& source, int64_t position, bool accepted);

  int64_t k_max_;
  StepCosts& costs_;
  SourceOf source_of_;
  // per source and draft position; empty until seen, then read as the position before it
  std::map<std::string, std::vector<std::optional<double>>> observed_;
  std::string source_;  // the current step's
  std::vector<int64_t> shadow_;
  std::string shadow_source_;
  int64_t shadow_start_ = 0, shadow_checked_ = 0;
  int64_t probe_interval_ = kFirstProbeInterval, plain_since_shadow_ = 0;
};

}  // namespace mtp
