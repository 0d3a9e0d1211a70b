#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace mtp {

Sampler::Sampler(const SamplingParams& params) : params_(params), state_(params.seed) {}

std::vector<double> softmax(const double* s, int64_t n) {
  double best = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) best = std::max(best, s[i]);
  std::vector<double> p(n);
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += (p[i] = std::exp(s[i] - best));
  for (double& x : p) x /= total;
  return p;
}

std::vector<double> softmax(const float* row, int64_t n) {
  std::vector<double> s(row, row + n);
  return softmax(s.data(), n);
}

std::vector<double> Sampler::probs(const float* logits, int64_t vocab) const {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> scores(vocab);
  for (int64_t i = 0; i < vocab; ++i) scores[i] = double(logits[i]) / params_.temperature;
  if (params_.top_k > 0 && params_.top_k < vocab) {
    std::vector<double> sorted = scores;
    std::nth_element(sorted.begin(), sorted.begin() + (params_.top_k - 1), sorted.end(),
                     std::greater<double>());
    const double kth = sorted[params_.top_k - 1];
    for (double& s : scores)
      if (s < kth) s = -inf;
  }
  if (params_.top_p < 1.0) {
    // Drop a token when the tokens before it already reach top_p; the best always stays.
    std::vector<int64_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return scores[a] > scores[b]; });
    std::vector<double> sorted(vocab);
    for (int64_t i = 0; i < vocab; ++i) sorted[i] = scores[order[i]];
    std::vector<double> p = softmax(sorted.data(), vocab);
    double before = 0;
    std::vector<bool> drop(vocab);
    for (int64_t i = 0; i < vocab; ++i) {
      drop[order[i]] = before >= params_.top_p;
      before += p[i];
    }
    for (int64_t i = 0; i < vocab; ++i)
      if (drop[i]) scores[i] = -inf;
  }
  return softmax(scores.data(), vocab);
}

double Sampler::uniform() {
  // splitmix64: small, fast, and the same sequence on every platform.
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return double(z >> 11) * 0x1.0p-53;
}

int64_t Sampler::sample(const std::vector<double>& probs) {
  double total = 0;
  for (double p : probs) total += p;
  const double u = uniform() * total;
  double cumulative = 0;
  int64_t last = 0;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0) continue;
    cumulative += probs[i];
    last = int64_t(i);
    if (u < cumulative) return last;
  }
  return last;  // rounding left u at the very top: the last token with mass
}

int64_t argmax(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (row[i] > row[best]) best = i;
  return best;
}

int64_t Sampler::pick(const float* logits, int64_t vocab) {
  return greedy() ? argmax(logits, vocab) : sample(probs(logits, vocab));
}

Accepted accept_greedy(const float* logits, int64_t vocab, const std::vector<int64_t>& draft) {
  int64_t n = 0;
  while (n < int64_t(draft.size()) && draft[n] == argmax(logits + n * vocab, vocab)) ++n;
  return {n, argmax(logits + n * vocab, vocab)};
}

namespace {

// norm(max(p - q, 0)): what to resample from after a rejection (p itself if nothing is left).
std::vector<double> residual(const std::vector<double>& p, const std::vector<double>& q) {
  std::vector<double> r(p.size());
  double total = 0;
  for (size_t i = 0; i < p.size(); ++i) total += (r[i] = std::max(p[i] - q[i], 0.0));
  if (total <= 0) return p;
  for (double& x : r) x /= total;
  return r;
}

}  // namespace

Accepted accept_sampling(const float* logits, int64_t vocab, const std::vector<int64_t>& draft,
                         const std::vector<std::vector<double>>& draft_probs, Sampler& sampler) {
  for (size_t i = 0; i < draft.size(); ++i) {
    std::vector<double> p = sampler.probs(logits + i * vocab, vocab);
    std::vector<double> q;
    if (draft_probs.empty()) {
      q.assign(vocab, 0.0);
      q[draft[i]] = 1.0;
    } else {
      q = draft_probs[i];
    }
    if (sampler.uniform() * q[draft[i]] < p[draft[i]]) continue;  // u < p/q, no division
    return {int64_t(i), sampler.sample(residual(p, q))};
  }
  return {int64_t(draft.size()), sampler.sample(sampler.probs(logits + draft.size() * vocab, vocab))};
}

}  // namespace mtp
