#include "bundle.h"

#include <fstream>
#include <sstream>
#include <sys/stat.h>

#include "errors.h"
#include "sha256.h"

namespace mtp {
namespace {

bool is_dir(const std::string& p) {
  struct stat s;
  return stat(p.c_str(), &s) == 0 && S_ISDIR(s.st_mode);
}

bool is_file(const std::string& p) {
  struct stat s;
  return stat(p.c_str(), &s) == 0 && S_ISREG(s.st_mode);
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  try {
    return nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    throw UserError(path + " is not valid JSON (" + e.what() + "): re-export the bundle");
  }
}

}  // namespace

std::string Manifest::path(const std::string& model) const {
  auto it = models.find(model);
  if (it == models.end()) throw UserError("bundle " + dir + " has no '" + model + "' file");
  return dir + "/" + it->second.file;
}

std::string Manifest::drafter_kind() const { return drafter.value("kind", std::string("none")); }

int Manifest::default_k() const { return drafter.value("k", 4); }

Manifest Manifest::load(const std::string& dir, bool verify) {
  if (!is_dir(dir)) throw UserError("bundle " + dir + " does not exist: export one with mtp-export");
  const std::string path = dir + "/manifest.json";
  if (!is_file(path)) throw UserError(dir + " is not a bundle: it has no manifest.json");
  nlohmann::json data = read_json(path);
  if (!data.contains("format_version") || data["format_version"] != kFormatVersion)
    throw UserError("bundle " + dir + " has format version " +
                    (data.contains("format_version") ? data["format_version"].dump() : "None") +
                    ", this runtime reads " + std::to_string(kFormatVersion) +
                    ": re-export it with this version of mtp-export");
  Manifest m;
  m.dir = dir;
  try {
    m.target = data.at("target").get<std::string>();
    m.backend = data.at("backend").get<std::string>();
    m.model_name = data.at("model_name").get<std::string>();
    m.max_seq_len = data.at("max_seq_len").get<int64_t>();
    m.max_chunk = data.at("max_chunk").get<int64_t>();
    m.vocab_size = data.at("vocab_size").get<int64_t>();
    if (!data.at("bos_id").is_null()) m.bos_id = data["bos_id"].get<int64_t>();
    m.eos_ids = data.at("eos_ids").get<std::vector<int64_t>>();
    m.drafter = data.at("drafter");
    for (auto& [name, entry] : data.at("models").items())
      m.models[name] = {entry.at("file").get<std::string>(), entry.at("sha256").get<std::string>(),
                        entry.contains("quant") && entry["quant"].is_object()
                            ? entry["quant"].value("attention", std::string())
                            : std::string()};
    m.has_chat_template = data.contains("chat_template") && !data["chat_template"].is_null();
    if (data.contains("chat_format") && !data["chat_format"].is_null())
      m.chat_format = ChatFormat{data["chat_format"].at("prefix").get<std::string>(),
                                 data["chat_format"].at("suffix").get<std::string>()};
  } catch (const nlohmann::json::exception& e) {
    throw UserError(path + " does not match the manifest schema (" + e.what() + ")");
  }
  const std::string meta = dir + "/tokenizer_meta.json";
  if (is_file(meta)) m.add_bos = read_json(meta).value("add_bos", false) && m.bos_id.has_value();
  if (verify) {
    for (const auto& [name, entry] : m.models) {
      const std::string file = dir + "/" + entry.file;
      if (!is_file(file)) throw UserError("bundle " + dir + " is missing " + entry.file + ": re-export it");
      if (sha256_file(file) != entry.sha256)
        throw UserError("bundle " + dir + ": " + entry.file +
                        " does not match its sha256 in manifest.json (modified or corrupted): "
                        "re-export the bundle");
    }
  }
  return m;
}

}  // namespace mtp
