#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>

#include <cstring>

#include "errors.h"
#include "llama_ops.h"
#include "model.h"

// The wheel ships the thread pool library but not its header; these two are what we call.
namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  bool _unsafe_reset_threadpool(uint32_t num_threads);
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool

namespace mtp {
namespace {

using executorch::aten::ScalarType;
using executorch::extension::from_blob;
using executorch::extension::Module;
using executorch::runtime::Error;
using executorch::runtime::EValue;

std::unique_ptr<Module> load(const std::string& pte) {
  register_llama_ops();
  auto module = std::make_unique<Module>(pte, Module::LoadMode::Mmap);
  if (module->load_method("forward") != Error::Ok)
    throw UserError("cannot load the forward method of " + pte +
                    ": not an mtp-export program, or built for another ExecuTorch version");
  return module;
}

class ExecuTorchModel : public Model {
 public:
  explicit ExecuTorchModel(const std::string& pte) : pte_(pte), module_(load(pte)) {}

  Output forward(const std::vector<int64_t>& tokens, int64_t start, bool want_hidden,
                 bool last_only) override {
    const int64_t T = int64_t(tokens.size());
    if (T < 1 || T > max_chunk)
      throw std::runtime_error("a call takes 1.." + std::to_string(max_chunk) + " tokens");
    if (start + T > max_seq_len) throw std::runtime_error("positions beyond the cache");
    std::vector<int64_t> ids = tokens;
    int64_t pos = start;
    auto ids_t = from_blob(ids.data(), {1, int32_t(T)}, ScalarType::Long);
    auto pos_t = from_blob(&pos, {1}, ScalarType::Long);
    auto result = module_->execute("forward", {EValue(ids_t), EValue(pos_t)});
    if (!result.ok())
      throw std::runtime_error("ExecuTorch forward failed on " + pte_ + " (error " +
                               std::to_string(int(result.error())) + ")");
    const auto& outputs = result.get();
    Output out;
    const auto& logits = outputs[0].toTensor();
    out.vocab = logits.size(2);
    const int64_t first = last_only ? T - 1 : 0;
    out.rows = T - first;
    const float* lp = logits.const_data_ptr<float>() + first * out.vocab;
    out.logits.assign(lp, lp + out.rows * out.vocab);
    if (want_hidden) {
      if (outputs.size() < 2)
        throw UserError(
            "this ExecuTorch program returns logits only, and the drafter needs the target's "
            "hidden states: re-export with --drafter mtp, or use ngram");
      const auto& hidden = outputs[1].toTensor();
      out.dim = hidden.size(2);
      const float* hp = hidden.const_data_ptr<float>() + first * out.dim;
      out.hidden.assign(hp, hp + out.rows * out.dim);
    }
    return out;
  }

 private:
  std::string pte_;
  std::unique_ptr<Module> module_;
};

class ExecuTorchStep : public StepProgram {
 public:
  explicit ExecuTorchStep(const std::string& pte) : pte_(pte), module_(load(pte)) {}

  void step(const std::vector<float>& h, int64_t token, std::vector<float>& logits,
            std::vector<float>& next_h) override {
    std::vector<float> h_in = h;
    int64_t tok = token;
    auto h_t = from_blob(h_in.data(), {1, int32_t(h_in.size())}, ScalarType::Float);
    auto tok_t = from_blob(&tok, {1}, ScalarType::Long);
    auto result = module_->execute("forward", {EValue(h_t), EValue(tok_t)});
    if (!result.ok())
      throw std::runtime_error("ExecuTorch step failed on " + pte_ + " (error " +
                               std::to_string(int(result.error())) + ")");
    const auto& l = result.get()[0].toTensor();
    const auto& g = result.get()[1].toTensor();
    logits.assign(l.const_data_ptr<float>(), l.const_data_ptr<float>() + l.numel());
    next_h.assign(g.const_data_ptr<float>(), g.const_data_ptr<float>() + g.numel());
  }

 private:
  std::string pte_;
  std::unique_ptr<Module> module_;
};

}  // namespace

Output prefill(Model& model, const std::vector<int64_t>& tokens, int64_t start,
               bool want_hidden) {
  Output out;
  for (size_t i = 0; i < tokens.size(); i += model.max_chunk) {
    size_t end = std::min(tokens.size(), i + size_t(model.max_chunk));
    std::vector<int64_t> chunk(tokens.begin() + i, tokens.begin() + end);
    out = model.forward(chunk, start + int64_t(i), want_hidden, /*last_only=*/true);
  }
  return out;
}

void set_executorch_threads(unsigned threads) {
  if (threads > 0) executorch::extension::threadpool::get_threadpool()->_unsafe_reset_threadpool(threads);
}

std::unique_ptr<Model> open_executorch_model(const std::string& pte, int64_t max_seq_len,
                                             int64_t max_chunk, int64_t vocab_size) {
  auto model = std::make_unique<ExecuTorchModel>(pte);
  model->max_seq_len = max_seq_len;
  model->max_chunk = max_chunk;
  model->vocab_size = vocab_size;
  return model;
}

std::unique_ptr<StepProgram> open_executorch_step(const std::string& pte) {
  return std::make_unique<ExecuTorchStep>(pte);
}

}  // namespace mtp
