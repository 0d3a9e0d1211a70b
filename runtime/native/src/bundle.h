// Reading a bundle's manifest.json: the same contract and checks as mtp_edge/manifest.py.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mtp {

constexpr int kFormatVersion = 1;

struct ModelFile {
  std::string file;  // relative to the bundle directory
  std::string sha256;
  // quant.attention: "mtp" when the program's attention is our row-exact op (every width of
  // forward gives the rows of one-token calls), "executorch" or empty otherwise.
  std::string attention;
};

// The chat template rendered around one user message at export time (C++ runs no jinja).
struct ChatFormat {
  std::string prefix;
  std::string suffix;
};

struct Manifest {
  std::string dir;
  std::string target, backend, model_name;
  int64_t max_seq_len = 0;
  int64_t max_chunk = 0;
  int64_t vocab_size = 0;
  std::optional<int64_t> bos_id;
  bool add_bos = false;  // from tokenizer_meta.json
  std::vector<int64_t> eos_ids;
  bool has_chat_template = false;
  std::optional<ChatFormat> chat_format;
  std::map<std::string, ModelFile> models;
  nlohmann::json drafter;  // {"kind": none|ngram|mtp|draft-lm, "k": int, ...}

  std::string path(const std::string& model) const;  // absolute path of models[model]
  std::string drafter_kind() const;
  int default_k() const;

  // Throws UserError (missing, malformed, wrong format version, or hash mismatch when verify).
  static Manifest load(const std::string& dir, bool verify = true);
};

}  // namespace mtp
