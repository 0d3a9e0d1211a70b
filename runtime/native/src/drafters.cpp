#include "drafters.h"

#include <algorithm>

#include "errors.h"

namespace mtp {

NgramDrafter::NgramDrafter(int max_n, int min_n) : max_n_(max_n), min_n_(min_n) {
  if (!(1 <= min_n && min_n <= max_n))
    throw UserError("n-gram sizes need 1 <= min <= max, got min " + std::to_string(min_n) +
                    ", max " + std::to_string(max_n));
}

Draft NgramDrafter::propose(const std::vector<int64_t>& context, const Hidden*,
                            int64_t k, Sampler&) {
  return {lookup(context, k), {}};
}

std::vector<int64_t> NgramDrafter::lookup(const std::vector<int64_t>& context, int64_t k) const {
  const int64_t len = int64_t(context.size());
  for (int64_t n = std::min<int64_t>(max_n_, len - 1); n >= min_n_; --n) {
    // Candidate windows of n tokens that end before the last token; the latest one wins.
    for (int64_t s = len - 1 - n; s >= 0; --s) {
      if (std::equal(context.begin() + s, context.begin() + s + n, context.end() - n)) {
        const int64_t start = s + n;
        const int64_t end = std::min(len, start + std::max<int64_t>(k, 0));
        return {context.begin() + start, context.begin() + end};
      }
    }
  }
  return {};
}

DraftModelDrafter::DraftModelDrafter(std::unique_ptr<Model> model, double min_confidence)
    : model_(std::move(model)), min_confidence_(min_confidence) {
  if (!(0 <= min_confidence && min_confidence < 1))
    throw UserError("draft confidence threshold must be in [0, 1)");
}

Draft DraftModelDrafter::propose(const std::vector<int64_t>& context, const Hidden*,
                                 int64_t k, Sampler& sampler) {
  k = std::min<int64_t>(k, model_->max_seq_len - int64_t(context.size()));
  if (k <= 0) return {};
  // Bring the cache up to the context; always re-feed at least the last token.
  size_t keep = 0;
  const size_t limit = std::min(cached_.size(), context.size() - 1);
  while (keep < limit && cached_[keep] == context[keep]) ++keep;
  std::vector<int64_t> rest(context.begin() + keep, context.end());
  Output out = prefill(*model_, rest, int64_t(keep), false);
  cached_ = context;
  std::vector<float> logits(out.logit_row(out.rows - 1), out.logit_row(out.rows - 1) + out.vocab);
  Draft draft;
  while (true) {
    std::vector<double> q = sampler.greedy() ? softmax(logits.data(), out.vocab)
                                             : sampler.probs(logits.data(), out.vocab);
    // Decide before drawing, so that kept tokens stay distributed as q.
    if (!draft.tokens.empty() && *std::max_element(q.begin(), q.end()) < min_confidence_) break;
    const int64_t token = sampler.greedy()
                              ? int64_t(std::max_element(q.begin(), q.end()) - q.begin())
                              : sampler.sample(q);
    draft.tokens.push_back(token);
    if (!sampler.greedy()) draft.probs.push_back(std::move(q));
    if (int64_t(draft.tokens.size()) == k) break;
    Output next = model_->forward({token}, int64_t(cached_.size()), false);
    logits.assign(next.logit_row(0), next.logit_row(0) + next.vocab);
    cached_.push_back(token);
  }
  return draft;
}

MtpDrafter::MtpDrafter(std::unique_ptr<StepProgram> step, std::vector<int64_t> draft_ids,
                       int64_t vocab_size, double min_confidence, int64_t cache_len,
                       bool feeds_context)
    : step_(std::move(step)),
      draft_ids_(std::move(draft_ids)),
      vocab_size_(vocab_size),
      min_confidence_(min_confidence),
      cache_len_(cache_len),
      feeds_context_(feeds_context) {
  if (!(0 <= min_confidence && min_confidence < 1))
    throw UserError("draft confidence threshold must be in [0, 1)");
}

void MtpDrafter::observe(const std::vector<int64_t>& context, const Hidden* hidden) {
  if (!feeds_context_ || hidden == nullptr || hidden->empty()) return;
  const int64_t rows = hidden->rows;
  std::vector<float> logits, next_h;
  step_->step(hidden->data, {context.end() - rows, context.end()},
              int64_t(context.size()) - rows, logits, next_h);
}

Draft MtpDrafter::propose(const std::vector<int64_t>& context, const Hidden* hidden, int64_t k,
                          Sampler& sampler) {
  Draft draft;
  if (hidden == nullptr || hidden->empty()) return draft;
  int64_t position = int64_t(context.size()) - 1;
  if (cache_len_ > 0) k = std::min(k, cache_len_ - position);
  if (k <= 0) {  // nothing to draft, but a self head's cache must still take in the rows
    observe(context, hidden);
    return draft;
  }
  std::vector<float> h, next_h, logits;
  std::vector<int64_t> feed;
  if (feeds_context_) {  // rows at positions len(context) - 1 - T .. len(context) - 2
    h = hidden->data;
    feed.assign(context.end() - hidden->rows, context.end());
  } else {
    h.assign(hidden->row(hidden->rows - 1), hidden->row(hidden->rows - 1) + hidden->dim);
    feed = {context.back()};
  }
  position -= int64_t(feed.size()) - 1;
  for (int64_t i = 0; i < k; ++i) {
    step_->step(h, feed, position, logits, next_h);
    position += int64_t(feed.size());
    h.swap(next_h);
    const int64_t width = int64_t(logits.size());
    int64_t token;
    if (sampler.greedy()) {
      const int64_t best = argmax(logits.data(), width);
      if (min_confidence_ > 0 && softmax(logits.data(), width)[best] < min_confidence_) break;
      token = draft_ids_[best];
    } else {
      std::vector<double> q_draft = sampler.probs(logits.data(), width);
      if (*std::max_element(q_draft.begin(), q_draft.end()) < min_confidence_) break;
      token = draft_ids_[sampler.sample(q_draft)];
      std::vector<double> q(vocab_size_, 0.0);
      for (int64_t j = 0; j < width; ++j) q[draft_ids_[j]] = q_draft[j];
      draft.probs.push_back(std::move(q));
    }
    draft.tokens.push_back(token);
    feed = {token};
  }
  return draft;
}

HybridDrafter::HybridDrafter(std::unique_ptr<Drafter> model, int max_n, int min_match)
    : model_(std::move(model)), lookup_(max_n, min_match) {}

Draft HybridDrafter::propose(const std::vector<int64_t>& context, const Hidden* hidden, int64_t k,
                             Sampler& sampler) {
  Draft draft;
  if (k > 0) draft = lookup_.propose(context, nullptr, k, sampler);
  if (draft.tokens.empty()) return model_->propose(context, hidden, k, sampler);
  model_->observe(context, hidden);
  ++from_lookup_;
  return draft;
}

std::string HybridDrafter::source(const std::vector<int64_t>& context) const {
  return lookup_.lookup(context, 1).empty() ? model_->name() : "lookup";
}

}  // namespace mtp
