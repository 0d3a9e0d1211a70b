// The session interface the loop runs on, and its ExecuTorch implementation (the C++ side of
// runtime/executorch_session.py). A model owns one static KV cache: forward(tokens, start)
// writes the tokens' K/V at positions start.. and returns their logits; a later call at the
// same positions overwrites rejected drafts, so there is no rollback call.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mtp {

struct Output {
  int64_t rows = 0, vocab = 0, dim = 0;
  std::vector<float> logits;  // [rows, vocab]
  std::vector<float> hidden;  // [rows, dim] when asked for, else empty
  const float* logit_row(int64_t i) const { return logits.data() + i * vocab; }
  const float* hidden_row(int64_t i) const { return hidden.data() + i * dim; }
};

class Model {
 public:
  virtual ~Model() = default;
  // Logits (and hidden states) for tokens at positions start..start+T-1; with last_only just
  // the last row's logits are returned (prefill needs no more), but the hidden states (when
  // asked for) of every row: a self MTP head reads them all.
  virtual Output forward(const std::vector<int64_t>& tokens, int64_t start, bool want_hidden,
                         bool last_only = false) = 0;
  int64_t max_seq_len = 0;
  int64_t max_chunk = 0;
  int64_t vocab_size = 0;
};

// The whole of `tokens` in chunks of max_chunk; returns the logits of the last row of the last
// chunk and (when asked for) the hidden states of every row, as runtime/session.py prefill.
Output prefill(Model& model, const std::vector<int64_t>& tokens, int64_t start, bool want_hidden);

// The MTP drafter's step: (h [T, D], tokens [T], position) -> (draft_logits [1, Vd], next h
// [1, D]) of the last row. `position` is where tokens[0] sits in the context: a head that reads
// the target's cache writes its K/V into the target's last-layer cache there and attends to the
// slots up to it; a self head writes and reads its own cache there (slots position - 1 ..); an
// MLP head ignores it. T is 1 except for a self head's first call of a draft (the verified rows).
class StepProgram {
 public:
  virtual ~StepProgram() = default;
  virtual void step(const std::vector<float>& h, const std::vector<int64_t>& tokens,
                    int64_t position, std::vector<float>& logits, std::vector<float>& next_h) = 0;
};

// Sets ExecuTorch's thread pool size (0 = leave it: one thread per core). Before any load.
void set_executorch_threads(unsigned threads);

// XNNPACK weight cache on or off for programs loaded from now on (see executorch_model.cpp): on,
// a program's methods share one packed copy of the weights they have in common. Unless set here,
// on, and the environment variable MTP_XNNPACK_WEIGHT_CACHE=0 turns it off.
void set_xnnpack_weight_cache(bool enabled);
bool xnnpack_weight_cache();

// row_exact_forward: the program's attention is our row-exact op, so calls of every width go
// through `forward` (no padding to `verify`'s width), as runtime/executorch_session.py does.
std::unique_ptr<Model> open_executorch_model(const std::string& pte, int64_t max_seq_len,
                                             int64_t max_chunk, int64_t vocab_size,
                                             bool row_exact_forward = false);
// A drafter program of its own: forward(h [1, D], token [1]) for MLP heads (max_chunk 0); for a
// self head (max_chunk > 0), forward(h [1, T, D], tokens [1, T], input_pos [1]) with its KV
// cache in the program, fed in chunks of at most max_chunk rows (the last chunk's outputs).
std::unique_ptr<StepProgram> open_executorch_step(const std::string& pte, int64_t max_chunk = 0);
// A method of the target's program, e.g. draft(h, token, input_pos): run on the same loaded
// program (the same ExecuTorch Module, whose methods share one mutable-buffer arena), so it reads
// and writes the target's KV cache. `target` must come from open_executorch_model; open the
// step before the target's first call.
std::unique_ptr<StepProgram> open_executorch_method_step(Model& target, const std::string& method);

}  // namespace mtp
