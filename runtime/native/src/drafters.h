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

class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual std::string name() const = 0;
  virtual bool needs_hidden() const { return false; }
  // context: every token so far (the last not yet in the target's cache); hidden: the target's
  // hidden state at the position of context[-2] (only for drafters that need it, else null).
  virtual Draft propose(const std::vector<int64_t>& context, const std::vector<float>* hidden,
                        int64_t k, Sampler& sampler) = 0;
};

// Prompt lookup: the latest earlier occurrence of the context's last n tokens (n from max_n
// down to min_n) and what followed it.
class NgramDrafter : public Drafter {
 public:
  NgramDrafter(int max_n = 3, int min_n = 1);
  std::string name() const override { return "ngram"; }
  Draft propose(const std::vector<int64_t>& context, const std::vector<float>* hidden, int64_t k,
                Sampler& sampler) override;

 private:
  int max_n_, min_n_;
};

// A separate small LM with the target's vocabulary and its own static KV cache; it keeps the
// longest prefix its cache shares with the new context and feeds the rest.
class DraftModelDrafter : public Drafter {
 public:
  DraftModelDrafter(std::unique_ptr<Model> model, double min_confidence = 0.0);
  std::string name() const override { return "draft-lm"; }
  Draft propose(const std::vector<int64_t>& context, const std::vector<float>* hidden, int64_t k,
                Sampler& sampler) override;

 private:
  std::unique_ptr<Model> model_;
  double min_confidence_;
  std::vector<int64_t> cached_;
};

// MTP heads run recurrently from the target's hidden state; draft_ids maps the head's reduced
// vocabulary back to target ids. Step i runs at position len(context) - 1 + i. cache_len > 0:
// the step writes the target's cache (a head that reads it), so drafting stops at its end.
class MtpDrafter : public Drafter {
 public:
  MtpDrafter(std::unique_ptr<StepProgram> step, std::vector<int64_t> draft_ids,
             int64_t vocab_size, double min_confidence = 0.0, int64_t cache_len = 0);
  std::string name() const override { return "mtp"; }
  bool needs_hidden() const override { return true; }
  Draft propose(const std::vector<int64_t>& context, const std::vector<float>* hidden, int64_t k,
                Sampler& sampler) override;

 private:
  std::unique_ptr<StepProgram> step_;
  std::vector<int64_t> draft_ids_;
  int64_t vocab_size_;
  double min_confidence_;
  int64_t cache_len_;
};

}  // namespace mtp
