#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/backend/backend_options_map.h>
#include <executorch/runtime/backend/options.h>

#include <atomic>
#include <cstdlib>
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

// XNNPACK's weight cache. Without it every XNNPACK delegate packs its own copy of its weights at
// load time, so a program whose methods (forward, verify, draft) run the same linears holds one
// packed copy per method. With it, the delegate looks each constant up by its named-data key (the
// sha256 of its bytes, how the exporter's XNNPACK partitioner stores them) in the backend's one
// process-wide heap cache and packs it only on the first miss; later delegates (other methods,
// and a drafter program with the same bytes) reuse the packed copy, and the cache drops an entry
// when the last delegate using it is destroyed. Turned on per load through the delegate's runtime
// spec (`weight_cache_enabled`, read by XnnpackBackendOptions::resolve_weight_cache), and turned
// off the same way (explicitly false, whatever the build's default), so both can be measured.
// -1: not set by set_xnnpack_weight_cache; then MTP_XNNPACK_WEIGHT_CACHE=0 turns it off.
std::atomic<int> weight_cache_setting{-1};

bool weight_cache_enabled() {
  const int setting = weight_cache_setting.load();
  if (setting >= 0) return setting != 0;
  const char* env = std::getenv("MTP_XNNPACK_WEIGHT_CACHE");
  return env == nullptr || std::strcmp(env, "0") != 0;
}

// The option arrays must outlive every method loaded with them: static storage.
const executorch::runtime::LoadBackendOptionsMap* xnnpack_load_options() {
  using executorch::runtime::BackendOptions;
  using executorch::runtime::LoadBackendOptionsMap;
  struct Maps {
    BackendOptions<1> on_options, off_options;
    LoadBackendOptionsMap on, off;
    Maps() {
      on_options.set_option("weight_cache_enabled", true);
      off_options.set_option("weight_cache_enabled", false);
      on.set_options("XnnpackBackend", on_options.view());
      off.set_options("XnnpackBackend", off_options.view());
    }
  };
  static Maps maps;
  return weight_cache_enabled() ? &maps.on : &maps.off;
}

Error load_method(Module& module, const std::string& method) {
  return module.load_method(method, /*planned_memory=*/nullptr, /*event_tracer=*/nullptr,
                            xnnpack_load_options());
}

std::shared_ptr<Module> load(const std::string& pte) {
  register_llama_ops();
  // Shared arenas: a program's forward, verify and draft methods keep one KV cache (a shared
  // mutable buffer); with separate arenas each method would write and read a cache of its own.
  // The Module sizes the shared arenas once, to the largest over all the program's methods, when
  // it loads the first method, so methods loaded later share them too. They share activation
  // memory as well: a method's outputs are copied out before another method runs.
  auto module = std::make_shared<Module>(pte, Module::LoadMode::Mmap, nullptr, nullptr, nullptr,
                                         /*share_memory_arenas=*/true);
  if (load_method(*module, "forward") != Error::Ok)
    throw UserError("cannot load the forward method of " + pte +
                    ": not an mtp-export program, or built for another ExecuTorch version");
  return module;
}

// Calls of 2..kExactRowsMax tokens (the loop's verifications) go through the program's `verify`
// method when it has one, in windows of its static width padded with copies of the last token
// (their rows are dropped and their cache slots overwritten by the next call): each row then
// equals bitwise the one-token forward at its position, whatever the kernels. A program on our
// row-exact attention op (row_exact_forward) takes every call through `forward` at its own
// width instead. The same rules as runtime/executorch_session.py, so both runtimes make the
// same calls.
constexpr int64_t kExactRowsMax = 16;

void append(Output& out, Output&& piece) {
  out.vocab = piece.vocab, out.dim = piece.dim;
  out.rows += piece.rows;
  out.logits.insert(out.logits.end(), piece.logits.begin(), piece.logits.end());
  out.hidden.insert(out.hidden.end(), piece.hidden.begin(), piece.hidden.end());
}

class ExecuTorchModel : public Model {
 public:
  explicit ExecuTorchModel(const std::string& pte) : pte_(pte), module_(load(pte)) {
    auto names = module_->method_names();
    if (names.ok() && names->count("verify") && load_method(*module_, "verify") == Error::Ok) {
      auto meta = module_->method_meta("verify");
      if (meta.ok() && meta->num_inputs() > 0) verify_width_ = meta->input_tensor_meta(0)->sizes()[1];
    }
    // An MTP bundle's forward returns the logits alone; the hidden states of its last call come
    // from `last_hidden` (a buffer the two methods share). Older programs return them second.
    has_last_hidden_ = names.ok() && names->count("last_hidden") &&
                       load_method(*module_, "last_hidden") == Error::Ok;
  }

  const std::string& pte() const { return pte_; }
  const std::shared_ptr<Module>& module() const { return module_; }
  bool row_exact_forward = false;  // see open_executorch_model

  Output forward(const std::vector<int64_t>& tokens, int64_t start, bool want_hidden,
                 bool last_only) override {
    const int64_t T = int64_t(tokens.size());
    if (T < 1 || T > max_chunk)
      throw std::runtime_error("a call takes 1.." + std::to_string(max_chunk) + " tokens");
    if (start + T > max_seq_len) throw std::runtime_error("positions beyond the cache");
    if (row_exact_forward || verify_width_ == 0 || T < 2 || T > kExactRowsMax)
      return call(tokens, start, want_hidden, last_only);
    Output out;
    for (int64_t i = 0; i < T; i += verify_width_) {
      const int64_t end = std::min(T, i + verify_width_);
      append(out, call({tokens.begin() + i, tokens.begin() + end}, start + i, want_hidden, false));
    }
    if (last_only) {  // the last row's logits; the hidden states of every row stay
      out.logits.erase(out.logits.begin(), out.logits.end() - out.vocab);
      out.rows = 1;
    }
    return out;
  }

 private:
  Output call(const std::vector<int64_t>& tokens, int64_t start, bool want_hidden,
              bool last_only) {
    const int64_t n = int64_t(tokens.size()), w = verify_width_;
    if (n == 1 || row_exact_forward || !(0 < n && n <= w))
      return run("forward", tokens, start, n, want_hidden, last_only);
    if (start + w <= max_seq_len) {
      std::vector<int64_t> padded = tokens;
      padded.resize(w, tokens.back());
      return run("verify", padded, start, n, want_hidden, last_only);
    }
    Output out;  // too close to the end of the cache for the padding: one row per call
    for (int64_t i = 0; i < n; ++i) append(out, run("forward", {tokens[i]}, start + i, 1, want_hidden, false));
    return out;
  }

  // Runs `method` on tokens at `start`; returns its first n rows (with last_only the logits of
  // row n-1 only, and the hidden states of all n).
  Output run(const char* method, const std::vector<int64_t>& tokens, int64_t start, int64_t n,
             bool want_hidden, bool last_only) {
    std::vector<int64_t> ids = tokens;
    int64_t pos = start;
    auto ids_t = from_blob(ids.data(), {1, int32_t(ids.size())}, ScalarType::Long);
    auto pos_t = from_blob(&pos, {1}, ScalarType::Long);
    auto result = module_->execute(method, {EValue(ids_t), EValue(pos_t)});
    if (!result.ok())
      throw std::runtime_error(std::string("ExecuTorch ") + method + " failed on " + pte_ +
                               " (error " + std::to_string(int(result.error())) + ")");
    const auto& outputs = result.get();
    Output out;
    const auto& logits = outputs[0].toTensor();
    out.vocab = logits.size(2);
    const int64_t first = last_only ? n - 1 : 0;
    out.rows = n - first;
    const float* lp = logits.const_data_ptr<float>() + first * out.vocab;
    out.logits.assign(lp, lp + out.rows * out.vocab);
    if (want_hidden) {
      auto take = [&](const EValue& value) {
        const auto& hidden = value.toTensor();
        out.dim = hidden.size(2);
        const float* hp = hidden.const_data_ptr<float>();
        out.hidden.assign(hp, hp + n * out.dim);
      };
      if (has_last_hidden_) {
        auto rows = module_->execute("last_hidden", std::vector<EValue>{});
        if (!rows.ok())
          throw std::runtime_error("ExecuTorch last_hidden failed on " + pte_ + " (error " +
                                   std::to_string(int(rows.error())) + ")");
        take(rows.get()[0]);
      } else if (outputs.size() >= 2) {
        take(outputs[1]);
      } else {
        throw UserError(
            "this ExecuTorch program returns logits only, and the drafter needs the target's "
            "hidden states: re-export with --drafter mtp, or use ngram");
      }
    }
    return out;
  }

  std::string pte_;
  std::shared_ptr<Module> module_;
  int64_t verify_width_ = 0;  // 0: the program has no verify method
  bool has_last_hidden_ = false;
};

// forward(h, token) of a drafter program of its own, or `method`(h, token, input_pos) of the
// target's program (then module is the target's, shared), or a self head's forward(h [1, T, D],
// tokens [1, T], input_pos) with its own cache, in chunks of at most max_chunk rows.
class ExecuTorchStep : public StepProgram {
 public:
  ExecuTorchStep(const std::string& pte, int64_t max_chunk)
      : pte_(pte), module_(load(pte)), takes_position_(max_chunk > 0), max_chunk_(max_chunk) {}
  ExecuTorchStep(const std::string& pte, std::shared_ptr<Module> module, const std::string& method)
      : pte_(pte),
        module_(std::move(module)),
        method_(method),
        takes_position_(method != "forward") {
    auto names = module_->method_names();
    if (!names.ok() || !names->count(method))
      throw UserError("the target program " + pte + " has no '" + method +
                      "' method: re-export the bundle");
    if (load_method(*module_, method) != Error::Ok)
      throw UserError("cannot load the " + method + " method of " + pte +
                      ": built for another ExecuTorch version?");
  }

  void step(const std::vector<float>& h, const std::vector<int64_t>& tokens, int64_t position,
            std::vector<float>& logits, std::vector<float>& next_h) override {
    const int64_t T = int64_t(tokens.size());
    if (T < 1 || h.size() % size_t(T) != 0)
      throw std::logic_error("a draft step takes T >= 1 rows of h and T tokens");
    const int64_t dim = int64_t(h.size()) / T;
    if (max_chunk_ == 0) {
      if (T != 1) throw std::logic_error("this drafter program takes one row per step");
      run({h.begin(), h.end()}, {tokens[0]}, position, {1, int32_t(dim)}, {1}, logits, next_h);
      return;
    }
    for (int64_t i = 0; i < T; i += max_chunk_) {  // a self head: the last chunk's outputs count
      const int64_t end = std::min(T, i + max_chunk_), rows = end - i;
      run({h.begin() + i * dim, h.begin() + end * dim}, {tokens.begin() + i, tokens.begin() + end},
          position + i, {1, int32_t(rows), int32_t(dim)}, {1, int32_t(rows)}, logits, next_h);
    }
  }

 private:
  void run(std::vector<float> h_in, std::vector<int64_t> tok, int64_t position,
           std::vector<executorch::aten::SizesType> h_shape,
           std::vector<executorch::aten::SizesType> tok_shape, std::vector<float>& logits,
           std::vector<float>& next_h) {
    int64_t pos = position;
    auto h_t = from_blob(h_in.data(), h_shape, ScalarType::Float);
    auto tok_t = from_blob(tok.data(), tok_shape, ScalarType::Long);
    auto pos_t = from_blob(&pos, {1}, ScalarType::Long);
    std::vector<EValue> inputs = {EValue(h_t), EValue(tok_t)};
    if (takes_position_) inputs.emplace_back(pos_t);
    auto result = module_->execute(method_, inputs);
    if (!result.ok())
      throw std::runtime_error("ExecuTorch " + method_ + " step failed on " + pte_ + " (error " +
                               std::to_string(int(result.error())) + ")");
    const auto& l = result.get()[0].toTensor();
    const auto& g = result.get()[1].toTensor();
    logits.assign(l.const_data_ptr<float>(), l.const_data_ptr<float>() + l.numel());
    next_h.assign(g.const_data_ptr<float>(), g.const_data_ptr<float>() + g.numel());
  }

  std::string pte_;
  std::shared_ptr<Module> module_;
  std::string method_ = "forward";
  bool takes_position_ = false;
  int64_t max_chunk_ = 0;  // > 0: a self head's program, T rows per call
};

}  // namespace

Output prefill(Model& model, const std::vector<int64_t>& tokens, int64_t start,
               bool want_hidden) {
  Output out;
  std::vector<float> hidden;
  for (size_t i = 0; i < tokens.size(); i += model.max_chunk) {
    size_t end = std::min(tokens.size(), i + size_t(model.max_chunk));
    std::vector<int64_t> chunk(tokens.begin() + i, tokens.begin() + end);
    out = model.forward(chunk, start + int64_t(i), want_hidden, /*last_only=*/true);
    hidden.insert(hidden.end(), out.hidden.begin(), out.hidden.end());
  }
  out.hidden = std::move(hidden);
  return out;
}

void set_executorch_threads(unsigned threads) {
  if (threads > 0) executorch::extension::threadpool::get_threadpool()->_unsafe_reset_threadpool(threads);
}

void set_xnnpack_weight_cache(bool enabled) { weight_cache_setting.store(enabled ? 1 : 0); }

bool xnnpack_weight_cache() { return weight_cache_enabled(); }

// The manifest's numbers against the constants mtp-export stored in the program
// (exporter/executorch.py, metadata_methods), as runtime/executorch_session.py checks them: an
// edited manifest is one line, not a read past the cache or an id past the embedding table.
static void check_constant(Module& module, const std::string& pte, const char* method,
                           const char* key, int64_t said) {
  auto names = module.method_names();
  if (!names.ok() || !names->count(method))
    throw UserError(pte + " carries no " + method +
                    " constant: it was not written by mtp-export; re-export the bundle");
  auto values = module.execute(method);
  if (!values.ok() || values->empty() || !(*values)[0].isInt())
    throw UserError("cannot read the " + std::string(method) + " constant of " + pte +
                    ": re-export the bundle");
  const int64_t value = (*values)[0].toInt();
  if (value == said) return;
  const size_t slash = pte.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : pte.substr(0, slash);
  const std::string file = slash == std::string::npos ? pte : pte.substr(slash + 1);
  throw UserError("bundle " + dir + ": manifest.json says " + key + " is " + std::to_string(said) +
                  " but " + file + " was exported with " + std::to_string(value) +
                  " (the manifest was edited): restore its manifest.json or re-export the bundle");
}

std::unique_ptr<Model> open_executorch_model(const std::string& pte, int64_t max_seq_len,
                                             int64_t max_chunk, int64_t vocab_size,
                                             bool row_exact_forward) {
  auto model = std::make_unique<ExecuTorchModel>(pte);
  check_constant(*model->module(), pte, "get_max_context_len", "max_seq_len", max_seq_len);
  check_constant(*model->module(), pte, "get_max_seq_len", "max_chunk", max_chunk);
  check_constant(*model->module(), pte, "get_vocab_size", "vocab_size", vocab_size);
  model->row_exact_forward = row_exact_forward;
  model->max_seq_len = max_seq_len;
  model->max_chunk = max_chunk;
  model->vocab_size = vocab_size;
  return model;
}

std::unique_ptr<StepProgram> open_executorch_step(const std::string& pte, int64_t max_chunk) {
  return std::make_unique<ExecuTorchStep>(pte, max_chunk);
}

std::unique_ptr<StepProgram> open_executorch_method_step(Model& target, const std::string& method) {
  auto* model = dynamic_cast<ExecuTorchModel*>(&target);
  if (model == nullptr) throw std::logic_error("the target is not an ExecuTorch program");
  return std::make_unique<ExecuTorchStep>(model->pte(), model->module(), method);
}

}  // namespace mtp
