// Drafters: runtime/drafters.py and runtime/mtp_drafter.py in C++. One interface; the loop does
// not know which drafter it has.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model.h"
#include "sampling.h"

namespace mtp {

struct Draft {
  std::vector<int64_t> tokens;
  // probs[i]: the distribution (target vocabulary) tokens[i] was drawn from; empty when the
  // tokens were chosen deterministically (greedy or lookup): one-hot for rejection sampling.
  std::vector<std::vector<double>> probs;
};

// The target's hidden states [rows, dim] for the positions its last call processed and kept:
// the prompt after prefill, the accepted inputs (n + 1 rows) after a verify. The last row is at
// the position of context[-2] (whose logits chose context[-1]).
struct Hidden {
  int64_t rows = 0, dim = 0;
  std::vector<float> data;  // [rows, dim]
  const float* row(int64_t i) const { return data.data() + i * dim; }
  bool empty() const { return rows == 0; }
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual std::string name() const = 0;
  virtual bool needs_hidden() const { return false; }
  // context: every token so far (the last not yet in the target's cache); hidden: the target's
  // hidden states of its last call (only for drafters that need them, else null).
  virtual Draft propose(const std::vector<int64_t>& context, const Hidden* hidden, int64_t k,
                        Sampler& sampler) = 0;
  // Told about a step another drafter drafted for (HybridDrafter), so that a drafter that must
  // see every verified position (a self MTP head: its cache) takes in its rows. Default: nothing.
  virtual void observe(const std::vector<int64_t>& context, const Hidden* hidden) {
    (void)context, (void)hidden;
  }
  // Which of its sources drafts next (one name for a drafter with one source): the fallback
  // measures each source's acceptance and cost apart.
  virtual std::string source(const std::vector<int64_t>& context) const {
    (void)context;
    return name();
  }
};

// Passes every call through to a drafter it does not own: lends a drafter kept elsewhere to one
// that wants to own it (HybridDrafter), and is the base of drafters that wrap another.
class ForwardingDrafter : public Drafter {
 public:
  explicit ForwardingDrafter(Drafter* inner) : inner_(inner) {}
  std::string name() const override { return inner_->name(); }
  bool needs_hidden() const override { return inner_->needs_hidden(); }
  Draft propose(const std::vector<int64_t>& context, const Hidden* hidden, int64_t k,
                Sampler& sampler) override {
    return inner_->propose(context, hidden, k, sampler);
  }
  void observe(const std::vector<int64_t>& context, const Hidden* hidden) override {
    inner_->observe(context, hidden);
  }
  std::string source(const std::vector<int64_t>& context) const override {
    return inner_->source(context);
  }

 private:
  Drafter* inner_;
};

// Prompt lookup: the latest earlier occurrence of the context's last n tokens (n from max_n
// down to min_n) and what followed it.
class NgramDrafter : public Drafter {
 public:
  NgramDrafter(int max_n = 3, int min_n = 1);
  std::string name() const override { return "ngram"; }
  Draft propose(const std::vector<int64_t>& context, const Hidden* hidden, int64_t k,
                Sampler& sampler) override;
  // The proposal's tokens: what followed the latest earlier occurrence, at most k.
  std::vector<int64_t> lookup(const std::vector<int64_t>& context, int64_t k) const;

 private:
  int max_n_, min_n_;
};

// A separate small LM with the target's vocabulary and its own static KV cache; it keeps the
// longest prefix its cache shares with the new context and feeds the rest.
class DraftModelDrafter : public Drafter {
 public:
  DraftModelDrafter(std::unique_ptr<Model> model, double min_confidence = 0.0);
  std::string name() const override { return "draft-lm"; }
  Draft propose(const std::vector<int64_t>& context, const Hidden* hidden, int64_t k,
                Sampler& sampler) override;

 private:
  std::unique_ptr<Model> model_;
  double min_confidence_;
  std::vector<int64_t> cached_;
};

// MTP heads run recurrently from the target's hidden state; draft_ids maps the head's reduced
// vocabulary back to target ids. Step i runs at position len(context) - 1 + i. cache_len > 0:
// the step writes a cache of that length (the target's, or a self head's own), so drafting stops
// at its end. feeds_context (a self, EAGLE-style head): the first step feeds every row of
// `hidden` with the tokens that follow them (context[-T:] at position len(context) - T), which
// fills the head's cache with the verified text; later steps feed one token each.
class MtpDrafter : public Drafter {
 public:
  MtpDrafter(std::unique_ptr<StepProgram> step, std::vector<int64_t> draft_ids,
             int64_t vocab_size, double min_confidence = 0.0, int64_t cache_len = 0,
             bool feeds_context = false);
  std::string name() const override { return "mtp"; }
  bool needs_hidden() const override { return true; }
  Draft propose(const std::vector<int64_t>& context, const Hidden* hidden, int64_t k,
                Sampler& sampler) override;
  // A self head's cache takes in the verified rows of a step it did not draft for.
  void observe(const std::vector<int64_t>& context, const Hidden* hidden) override;

 private:
  std::unique_ptr<StepProgram> step_;
  std::vector<int64_t> draft_ids_;
  int64_t vocab_size_;
  double min_confidence_;
  int64_t cache_len_;
  bool feeds_context_;
};

// Prompt lookup where the context repeats itself, a model drafter elsewhere
// (runtime/drafters.py HybridDrafter): the n-gram lookup (sizes max_n down to min_match) runs
// first; when it proposes tokens they are the draft and the model drafter only observes the
// step, otherwise the model drafts. Named "<model>+ngram".
class HybridDrafter : public Drafter {
 public:
  HybridDrafter(std::unique_ptr<Drafter> model, int max_n = 3, int min_match = 1);
  std::string name() const override { return model_->name() + "+ngram"; }
  bool needs_hidden() const override { return model_->needs_hidden(); }
  Draft propose(const std::vector<int64_t>& context, const Hidden* hidden, int64_t k,
                Sampler& sampler) override;
  // The model drafter takes in the rows of a step neither drafted for.
  void observe(const std::vector<int64_t>& context, const Hidden* hidden) override {
    model_->observe(context, hidden);
  }
  // "lookup" where the context's last tokens occurred before, else the model's name.
  std::string source(const std::vector<int64_t>& context) const override;
  int64_t from_lookup() const { return from_lookup_; }  // drafts the lookup made

 private:
  std::unique_ptr<Drafter> model_;
  NgramDrafter lookup_;
  int64_t from_lookup_ = 0;
};

}  // namespace mtp
