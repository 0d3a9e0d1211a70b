// Reading a bundle's manifest.json: the same contract and checks as mtp_edge/manifest.py.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mtp {

constexpr int kFormatVersion = 2;  // 2: the platform's key is "platform"

struct ModelFile {
  std::string file;  // relative to the bundle directory
  std::string sha256;
  // quant.attention: "mtp" when the program's attention is our row-exact op (every width of
  // forward gives the rows of one-token calls), "executorch" or empty otherwise.
  std::string attention;
  std::string scheme;  // quant.scheme: "8da8w", "8da4w", "fp32"...
  int64_t group_size = 0;  // quant.group_size: input columns per weight scale (0: per channel)
};

// How this CPU multiplies int8 (mtp_edge/machine.py INT8_PATHS: the same names and rows):
// whether it has a dot-product instruction, and the rows of XNNPACK's per-channel 8-bit GEMM
// tile on it (0: not known). MTP_EDGE_INT8_PATH names it instead of the CPU's flags; a name
// that is not a path throws UserError.
struct Int8Path {
  std::string name;
  bool dot_product = false;
  int rows = 0;
  int blockwise_rows = 0;  // the tile of XNNPACK's 4-bit GEMM in groups (qb4w; 0: not known)
};
Int8Path host_int8_path();

// The chat template rendered around one user message at export time (C++ runs no jinja).
// A conversation renders as prefix (or system_prefix + system prompt + system_suffix) + user +
// suffix + answer + next_turn + user + suffix + ...; bundles whose template does not render so
// (or older ones) have no next_turn (one turn per conversation) or no system frame.
struct ChatFormat {
  std::string prefix;
  std::string suffix;
  std::optional<std::string> next_turn;
  std::optional<std::string> system_prefix, system_suffix;
};

// manifest.json's "drafter" (mtp_edge/manifest.py DrafterSpec: the same keys and meanings).
struct DrafterSpec {
  std::string kind = "none";  // none | ngram | mtp | draft-lm
  int64_t k = 4;              // tokens drafted per step
  std::optional<std::string> lookup;  // "MIN-MAX": prompt lookup before the model drafter
  double draft_confidence = 0.0;      // no draft below this first-token probability
  std::optional<std::string> model_name;  // draft-lm
  std::optional<int64_t> draft_vocab_size, hidden_size;  // mtp
  std::optional<std::string> method;  // mtp: a method of the target's program, on its cache
  bool reads_target_cache = false;
  bool own_cache = false;  // a self (EAGLE) head with a cache of its own
  int64_t max_chunk = 0;   // own_cache: most rows per call of the head's program
  // recipe (how the heads were trained) and functions (Core ML) are checked, not kept.
};

struct Manifest {
  std::string dir;
  std::string platform, backend, model_name;
  int64_t max_seq_len = 0;
  int64_t max_chunk = 0;
  int64_t vocab_size = 0;
  std::optional<int64_t> bos_id;
  bool add_bos = false;  // from tokenizer_meta.json
  std::vector<int64_t> eos_ids;
  bool has_chat_template = false;
  std::optional<ChatFormat> chat_format;
  std::map<std::string, ModelFile> models;
  DrafterSpec drafter;

  std::string path(const std::string& model) const;  // absolute path of models[model]
  std::string drafter_kind() const { return drafter.kind; }
  int default_k() const { return static_cast<int>(drafter.k); }
  // The bundle's k on this CPU (runtime/assemble.py k_for_this_cpu, the same rule): an 8da8w
  // ExecuTorch target on a CPU without an int8 dot product keeps k + 1 within the GEMM's tile,
  // an 8da8w-avx2 or 8da4w-mix-avx2 one within our kernels' 6 rows on every CPU.
  int64_t k_for_this_cpu() const;
  // Whether every linear of the target runs a kernel of ours (8da8w-avx2, 8da4w-mix-avx2).
  bool own_kernels() const;
  // Rows of the XNNPACK GEMM tile that bounds a verification of the target on this CPU, 0 where
  // none does (runtime/assemble.py xnnpack_tile_rows): the per-channel 8-bit GEMM's for 8da8w
  // and per-channel 8da4w, the 4-bit groupwise GEMM's for 8da4w and 8da4w-mix in groups.
  int tile_rows() const;
  std::string target_scheme() const;  // the target's quantization scheme ("" if none)

  // Throws UserError (missing, malformed, wrong format version, or hash mismatch when verify).
  static Manifest load(const std::string& dir, bool verify = true);
};

}  // namespace mtp
