// The sampler and the two verification rules: runtime/sampling.py in C++.
//
// Greedy is token-identical to Python. Sampling follows the same distributions and the same
// rejection rule, but draws from its own seeded generator (splitmix64), not torch's: the same
// seed gives the same samples run after run here, not the same samples as the Python runtime.
#pragma once

#include <cstdint>
#include <vector>

namespace mtp {

struct SamplingParams {
  double temperature = 0.0;  // 0 = greedy
  int top_k = 0;             // 0 = off
  double top_p = 1.0;        // 1 = off
  uint64_t seed = 0;
  bool greedy() const { return temperature == 0.0; }
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  bool greedy() const { return params_.greedy(); }
  // One row of logits -> probabilities (float64) after temperature, top-k, top-p.
  std::vector<double> probs(const float* logits, int64_t vocab) const;
  int64_t sample(const std::vector<double>& probs);
  double uniform();  // in [0, 1)
  int64_t pick(const float* logits, int64_t vocab);  // argmax when greedy, else a sample

 private:
  SamplingParams params_;
  uint64_t state_;
};

int64_t argmax(const float* row, int64_t n);  // first index of the largest value
std::vector<double> softmax(const float* row, int64_t n);

struct Accepted {
  int64_t n;           // draft tokens kept
  int64_t next_token;  // the target's own token after them (correction or bonus)
};

// logits: [len(draft)+1, vocab]; row i is the target's prediction after draft[:i].
Accepted accept_greedy(const float* logits, int64_t vocab, const std::vector<int64_t>& draft);

// Rejection sampling; draft_probs[i] is the distribution draft[i] was drawn from (empty: drawn
// deterministically, a one-hot distribution).
Accepted accept_sampling(const float* logits, int64_t vocab, const std::vector<int64_t>& draft,
                         const std::vector<std::vector<double>>& draft_probs, Sampler& sampler);

}  // namespace mtp
