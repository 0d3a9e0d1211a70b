// Every arithmetic step here is runtime/fallback.py's, in the same order, so that given the same
// reported costs the two runtimes compare the same doubles (CMakeLists builds this file without
// floating-point contraction, which would fuse a multiply and an add where Python rounds twice).
#include "fallback.h"

#include <algorithm>
#include <utility>

namespace mtp {
namespace {

double average(double old, double value, double weight) { return old + weight * (value - old); }

// A timing's average; a stall (another process took the core) counts as kOutlier times it.
double average_time(double old, double value) {
  return average(old, old > 0 ? std::min(value, kOutlier * old) : value, kCostWeight);
}

double prior_ratio(int64_t width) { return 1 + kPriorVerifySlope * double(width - 1); }

double median(const std::deque<double>& calls) {
  std::vector<double> sorted(calls.begin(), calls.end());
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size(), mid = n / 2;
  return n % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
}

// A width's cost from other widths': interpolated, or scaled by the prior slope.
std::optional<double> from_neighbours(const std::map<int64_t, double>& measured, int64_t width) {
  std::optional<int64_t> below, above;  // the nearest measured widths on either side
  for (const auto& [w, seconds] : measured) {
    (void)seconds;
    if (w < width) below = w;
    if (w > width && !above) above = w;
  }
  if (below && above) {
    const double lo = measured.at(*below), hi = measured.at(*above);
    const double share = double(width - *below) / double(*above - *below);
    return lo + share * (hi - lo);
  }
  if (below || above) {
    const int64_t near = below ? *below : *above;
    return measured.at(near) * prior_ratio(width) / prior_ratio(near);
  }
  return std::nullopt;
}

}  // namespace

void StepCosts::record_verify(int64_t width, double seconds) {
  std::deque<double>& calls = verify[width];
  calls.push_back(seconds);
  if (calls.size() > kRecentCalls) calls.pop_front();
  measured[width] = median(calls);
  steps_since_plain = width == 1 ? 0 : steps_since_plain + 1;
}

void StepCosts::record_draft(const std::string& source, int64_t requested, double seconds) {
  const double per_token = seconds / double(requested);
  const auto old = draft.find(source);
  draft[source] = old == draft.end() ? per_token : average_time(old->second, per_token);
}

std::optional<double> StepCosts::verify_seconds(int64_t width) const {
  const auto calls = verify.find(width);
  const size_t count = calls == verify.end() ? 0 : calls->second.size();
  if (count >= kTrustedCalls) return measured.at(width);
  std::map<int64_t, double> trusted;
  for (const auto& [w, seconds] : measured)
    if (verify.at(w).size() >= kTrustedCalls) trusted[w] = seconds;
  std::optional<double> estimate = from_neighbours(trusted.empty() ? measured : trusted, width);
  if (count > 0)
    estimate = estimate ? std::min(*estimate, measured.at(width)) : measured.at(width);
  if (!estimate) return std::nullopt;
  for (const auto& [w, seconds] : trusted)
    if (w > width) estimate = std::min(*estimate, seconds);
  return estimate;
}

double CostModel::verify_seconds(int64_t width) const {
  return verify_ms * (1 + slope * double(width - 1)) / 1e3;
}

double CostModel::draft_seconds(const std::string& source, int64_t requested) const {
  return source == "ngram" || source == "lookup" ? 0.0 : double(requested) * draft_ms / 1e3;
}

Fallback::Fallback(int64_t k_max, StepCosts& costs, SourceOf source_of)
    : k_max_(k_max), costs_(costs), source_of_(std::move(source_of)) {}

std::vector<double> Fallback::acceptance(const std::string& source) const {
  std::vector<double> out;
  double last = kPriorAcceptance;
  const auto seen = observed_.find(source);
  for (int64_t i = 0; i < k_max_; ++i) {
    if (seen != observed_.end() && seen->second[i]) last = *seen->second[i];
    out.push_back(last);
  }
  return out;
}

int64_t Fallback::best_k(int64_t k, const std::string& source) const {
  const std::optional<double> plain = costs_.verify_seconds(1);
  if (!plain) return 0;  // measure a plain step first: everything else is judged against it
  const auto found = costs_.draft.find(source);
  const double draft = found == costs_.draft.end() ? 0.0 : found->second;
  int64_t best = 0;
  double best_rate = 1.0 / *plain, tokens = 1.0, reach = 1.0;
  const std::vector<double> a = acceptance(source);
  for (int64_t n = 1; n <= std::min(k, k_max_); ++n) {
    reach *= a[n - 1];
    tokens += reach;
    const double rate = tokens / (*costs_.verify_seconds(n + 1) + double(n) * draft);
    if (rate > best_rate) {
      best = n;
      best_rate = rate;
    }
  }
  return best;
}

Fallback::Plan Fallback::plan(int64_t k, const std::vector<int64_t>& context) {
  if (k <= 0) return {};
  source_ = source_of_(context);
  if (costs_.steps_since_plain >= kRemeasurePlainAfter) return {0, wants_shadow(k)};
  const int64_t best = best_k(k, source_);
  if (best > 0) {
    probe_interval_ = kFirstProbeInterval;
    return {best, false};
  }
  return {0, wants_shadow(k)};
}

bool Fallback::wants_shadow(int64_t k) {
  if (!shadow_.empty()) return false;  // one at a time: the pending one is still compared
  const std::optional<double> plain = costs_.verify_seconds(1);
  const auto draft = costs_.draft.find(source_);
  if (draft == costs_.draft.end() || !plain || double(k) * draft->second <= kCheapShadow * *plain)
    return true;
  if (++plain_since_shadow_ < probe_interval_) return false;
  plain_since_shadow_ = 0;
  probe_interval_ = std::min(2 * probe_interval_, kMaxProbeInterval);
  return true;
}

void Fallback::record_step(int64_t requested, int64_t drafted, int64_t accepted,
                           double draft_seconds, double verify_seconds) {
  if (requested > 0) costs_.record_draft(source_, requested, draft_seconds);
  costs_.record_verify(drafted + 1, verify_seconds);
  for (int64_t i = 0; i < std::min(accepted + 1, drafted); ++i) observe(source_, i, i < accepted);
}

void Fallback::start_shadow(std::vector<int64_t> tokens, int64_t start) {
  shadow_ = std::move(tokens);
  shadow_start_ = start;
  shadow_checked_ = 0;
  shadow_source_ = source_;
}

void Fallback::check_shadow(const std::vector<int64_t>& context) {
  while (!shadow_.empty() && shadow_checked_ < int64_t(shadow_.size())) {
    const int64_t index = shadow_start_ + shadow_checked_;
    if (index >= int64_t(context.size())) return;
    const bool hit = context[index] == shadow_[shadow_checked_];
    observe(shadow_source_, shadow_checked_, hit);
    ++shadow_checked_;
    if (!hit) break;
  }
  shadow_.clear();
}

void Fallback::observe(const std::string& source, int64_t position, bool accepted) {
  if (position >= k_max_) return;
  const double estimate = acceptance(source)[position];
  auto& seen = observed_.try_emplace(source, std::vector<std::optional<double>>(k_max_)).first->second;
  seen[position] = average(estimate, accepted ? 1.0 : 0.0, kAcceptanceWeight);
}

}  // namespace mtp
