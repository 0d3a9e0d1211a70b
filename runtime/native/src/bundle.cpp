#include "bundle.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

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

// The types of manifest.json's values, as mtp_edge/manifest.py declares them.
enum class Kind { Text, Integer, Number, Bool, Object, TextOrNull, IntegerOrNull, ObjectOrNull, Integers };

struct Key {
  const char* name;
  Kind kind;
  bool required;
};

const char* describe(Kind kind) {
  switch (kind) {
    case Kind::Text: return "text";
    case Kind::Integer: return "an integer";
    case Kind::Number: return "a number";
    case Kind::Bool: return "true or false";
    case Kind::Object: return "an object";
    case Kind::TextOrNull: return "text or null";
    case Kind::IntegerOrNull: return "an integer or null";
    case Kind::ObjectOrNull: return "an object or null";
    case Kind::Integers: return "a list of integers";
  }
  return "?";
}

bool is_a(const nlohmann::json& v, Kind kind) {
  switch (kind) {
    case Kind::Text: return v.is_string();
    case Kind::Integer: return v.is_number_integer();
    case Kind::Number: return v.is_number();
    case Kind::Bool: return v.is_boolean();
    case Kind::Object: return v.is_object();
    case Kind::TextOrNull: return v.is_null() || v.is_string();
    case Kind::IntegerOrNull: return v.is_null() || v.is_number_integer();
    case Kind::ObjectOrNull: return v.is_null() || v.is_object();
    case Kind::Integers:
      if (!v.is_array()) return false;
      for (const auto& x : v)
        if (!x.is_number_integer()) return false;
      return true;
  }
  return false;
}

// Every key of `data` known, present when required and of its type; else one UserError that
// names the key (the messages mtp_edge/manifest.py gives).
void check_keys(const nlohmann::json& data, const std::vector<Key>& keys, const std::string& where,
                const std::string& section) {
  const std::string prefix = section.empty() ? "" : section + ".";
  if (!data.is_object())
    throw UserError(where + ": '" + section + "' must be an object: re-export the bundle");
  std::vector<std::string> unknown;
  for (auto it = data.begin(); it != data.end(); ++it) {
    bool known = false;
    for (const auto& key : keys) known = known || it.key() == key.name;
    if (!known) unknown.push_back(it.key());
  }
  if (!unknown.empty()) {
    std::sort(unknown.begin(), unknown.end());
    throw UserError(where + ": unknown key '" + prefix + unknown[0] +
                    "' (written by a newer mtp-export?): re-export the bundle with this version");
  }
  for (const auto& key : keys) {
    if (!data.contains(key.name)) {
      if (key.required)
        throw UserError(where + ": missing key '" + prefix + key.name + "': re-export the bundle");
      continue;
    }
    if (!is_a(data[key.name], key.kind))
      throw UserError(where + ": '" + prefix + key.name + "' must be " + describe(key.kind) +
                      ", not " + data[key.name].dump().substr(0, 40) + ": re-export the bundle");
  }
}

const std::vector<Key> kManifestKeys = {
    {"platform", Kind::Text, true},        {"backend", Kind::Text, true},
    {"model_name", Kind::Text, true},      {"max_seq_len", Kind::Integer, true},
    {"max_chunk", Kind::Integer, true},    {"vocab_size", Kind::Integer, true},
    {"bos_id", Kind::IntegerOrNull, true}, {"eos_ids", Kind::Integers, true},
    {"chat_template", Kind::TextOrNull, true}, {"models", Kind::Object, true},
    {"drafter", Kind::Object, true},       {"quality", Kind::Object, false},
    {"chat_format", Kind::ObjectOrNull, false}, {"format_version", Kind::Integer, false},
    {"exporter_version", Kind::Text, false}, {"export_log", Kind::Object, false},
    {"source", Kind::ObjectOrNull, false},
};

const std::vector<Key> kModelFileKeys = {
    {"file", Kind::Text, true},
    {"sha256", Kind::Text, true},
    {"quant", Kind::Object, true},
    {"methods", Kind::Object, true},
};

const std::vector<Key> kDrafterKeys = {
    {"kind", Kind::Text, false},          {"k", Kind::Integer, false},
    {"lookup", Kind::TextOrNull, false},  {"draft_confidence", Kind::Number, false},
    {"model_name", Kind::TextOrNull, false}, {"draft_vocab_size", Kind::IntegerOrNull, false},
    {"hidden_size", Kind::IntegerOrNull, false}, {"method", Kind::TextOrNull, false},
    {"reads_target_cache", Kind::Bool, false}, {"own_cache", Kind::Bool, false},
    {"max_chunk", Kind::Integer, false},  {"recipe", Kind::Object, false},
    {"functions", Kind::Object, false},
};

template <typename T>
std::optional<T> optional_value(const nlohmann::json& data, const char* key) {
  if (!data.contains(key) || data[key].is_null()) return std::nullopt;
  return data[key].get<T>();
}

DrafterSpec read_drafter(const nlohmann::json& d, const std::string& where) {
  check_keys(d, kDrafterKeys, where, "drafter");
  DrafterSpec spec;
  spec.kind = d.value("kind", spec.kind);
  if (spec.kind != "none" && spec.kind != "ngram" && spec.kind != "mtp" && spec.kind != "draft-lm")
    throw UserError(where + ": 'drafter.kind' is '" + spec.kind +
                    "', not one of none, ngram, mtp, draft-lm: re-export the bundle");
  spec.k = d.value("k", spec.k);
  spec.lookup = optional_value<std::string>(d, "lookup");
  spec.draft_confidence = d.value("draft_confidence", spec.draft_confidence);
  spec.model_name = optional_value<std::string>(d, "model_name");
  spec.draft_vocab_size = optional_value<int64_t>(d, "draft_vocab_size");
  spec.hidden_size = optional_value<int64_t>(d, "hidden_size");
  spec.method = optional_value<std::string>(d, "method");
  spec.reads_target_cache = d.value("reads_target_cache", false);
  spec.own_cache = d.value("own_cache", false);
  spec.max_chunk = d.value("max_chunk", int64_t(0));
  return spec;
}

// The name a manifest gives for a value in a message, on one line whatever it holds.
std::string shown(const std::string& value) {
  std::string out;
  for (unsigned char c : value) {
    if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += char(c);
    }
  }
  return out;
}

// models.*.file names one entry of the bundle directory: no separators, no "." or "..", nothing
// absolute, no NUL (which would cut the name short when opened).
bool plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find_first_of(std::string("/\\\0", 3)) == std::string::npos;
}

std::optional<std::string> real_path(const std::string& path) {
  char* resolved = ::realpath(path.c_str(), nullptr);
  if (!resolved) return std::nullopt;
  std::string out(resolved);
  std::free(resolved);
  return out;
}

bool inside(const std::string& path, const std::string& real_dir) {
  const std::string prefix = real_dir == "/" ? real_dir : real_dir + "/";
  return path.size() > prefix.size() && path.compare(0, prefix.size(), prefix) == 0;
}

// Every models.*.file a plain name, and the tokenizer's files among them (what the runtime reads
// is what the manifest hashes): checked before any file is opened, as mtp_edge/manifest.py does.
const std::vector<std::pair<std::string, std::string>> kTokenizerFiles = {
    {"tokenizer", "tokenizer.json"}, {"tokenizer_meta", "tokenizer_meta.json"}};

void check_file_names(const Manifest& m, const std::string& where) {
  for (const auto& [name, entry] : m.models)
    if (!plain_file_name(entry.file))
      throw UserError(where + ": models." + name + ".file '" + shown(entry.file) +
                      "' is not a plain file name inside the bundle: re-export the bundle");
  for (const auto& [role, file] : kTokenizerFiles) {
    const auto it = m.models.find(role);
    if (it == m.models.end() || it->second.file != file)
      throw UserError("bundle " + m.dir + " has no sha256 for " + file +
                      " in manifest.json (exported by an older mtp-export): re-export it");
  }
}

// A models.*.file that is a symlink resolves inside the bundle directory.
void check_links(const Manifest& m, const std::string& where) {
  std::optional<std::string> real_dir;
  for (const auto& [name, entry] : m.models) {
    struct stat s;
    if (lstat((m.dir + "/" + entry.file).c_str(), &s) != 0 || !S_ISLNK(s.st_mode)) continue;
    if (!real_dir) real_dir = real_path(m.dir);
    const auto target = real_path(m.dir + "/" + entry.file);
    // A dangling link is a missing file, refused as such when the files are checked.
    if (target && !(real_dir && inside(*target, *real_dir)))
      throw UserError(where + ": models." + name + ".file '" + shown(entry.file) +
                      "' links outside the bundle: re-export the bundle");
  }
}

// The sha256 of a directory (a Core ML .mlpackage), as mtp_edge/manifest.py sha256 computes it:
// its files (symlinks to files too, symlinked directories not entered) in the order of their
// relative paths' components, each as "relative/path\0" then its bytes.
void list_files(const std::string& root, std::vector<std::string>& parts,
                std::vector<std::vector<std::string>>& out) {
  std::string dir = root;
  for (const auto& p : parts) dir += "/" + p;
  DIR* d = opendir(dir.c_str());
  if (!d) throw UserError("cannot read the directory " + dir);
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(d);
  for (const auto& name : names) {
    const std::string path = dir + "/" + name;
    struct stat ls, s;
    if (lstat(path.c_str(), &ls) != 0) continue;
    parts.push_back(name);
    if (S_ISDIR(ls.st_mode))
      list_files(root, parts, out);
    else if (stat(path.c_str(), &s) == 0 && S_ISREG(s.st_mode))
      out.push_back(parts);
    parts.pop_back();
  }
}

std::string sha256_dir(const std::string& root) {
  std::vector<std::vector<std::string>> files;
  std::vector<std::string> parts;
  list_files(root, parts, files);
  std::sort(files.begin(), files.end());
  Sha256 digest;
  std::vector<char> buf(1 << 20);
  for (const auto& file : files) {
    std::string relative;
    for (const auto& p : file) relative += (relative.empty() ? "" : "/") + p;
    digest.update(relative.data(), relative.size());
    digest.update("", 1);
    std::FILE* f = std::fopen((root + "/" + relative).c_str(), "rb");
    if (!f) throw UserError("cannot read " + root + "/" + relative);
    size_t n;
    while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) digest.update(buf.data(), n);
    std::fclose(f);
  }
  return digest.hex_digest();
}

// The verified-once stamp: <cache>/mtp-edge/verified/<32 hex of sha256(realpath)>.json, written
// after a full check passes, {"bundle": realpath, "files": {name: {size, mtime_ns, sha256}}}; a
// file whose size and mtime match its entry, and whose entry's sha256 is the manifest's, is not
// hashed again. mtp_edge/manifest.py reads and writes the same file. Nothing depends on it being
// there or writable.
struct Seen {
  int64_t size = 0, mtime_ns = 0;
  std::string sha256;
};

std::optional<Seen> seen_now(const std::string& path) {
  struct stat s;
  if (stat(path.c_str(), &s) != 0 || !S_ISREG(s.st_mode)) return std::nullopt;
#ifdef __APPLE__
  const auto& t = s.st_mtimespec;
#else
  const auto& t = s.st_mtim;
#endif
  return Seen{int64_t(s.st_size), int64_t(t.tv_sec) * 1000000000 + int64_t(t.tv_nsec), ""};
}

std::optional<std::string> stamp_path(const std::string& real_dir) {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  std::string cache;
  if (xdg && *xdg)
    cache = xdg;
  else if (home && *home)
    cache = std::string(home) + "/.cache";
  else
    return std::nullopt;
  return cache + "/mtp-edge/verified/" + sha256_hex(real_dir).substr(0, 32) + ".json";
}

std::map<std::string, Seen> read_stamp(const std::string& path, const std::string& real_dir) {
  std::map<std::string, Seen> files;
  std::ifstream in(path, std::ios::binary);
  if (!in) return files;
  const nlohmann::json data = nlohmann::json::parse(in, nullptr, false);
  if (!data.is_object() || !data.contains("bundle") || data["bundle"] != real_dir ||
      !data.contains("files") || !data["files"].is_object())
    return files;
  for (const auto& [name, entry] : data["files"].items()) {
    if (!entry.is_object() || !entry.contains("size") || !entry["size"].is_number_integer() ||
        !entry.contains("mtime_ns") || !entry["mtime_ns"].is_number_integer() ||
        !entry.contains("sha256") || !entry["sha256"].is_string())
      continue;
    files[name] = {entry["size"].get<int64_t>(), entry["mtime_ns"].get<int64_t>(),
                   entry["sha256"].get<std::string>()};
  }
  return files;
}

bool make_dirs(const std::string& path) {
  struct stat s;
  if (stat(path.c_str(), &s) == 0) return S_ISDIR(s.st_mode);
  const auto slash = path.find_last_of('/');
  if (slash != std::string::npos && slash > 0 && !make_dirs(path.substr(0, slash))) return false;
  return mkdir(path.c_str(), 0755) == 0 || errno == EEXIST;
}

// Atomically (a unique temporary name, then rename); silently nothing when it cannot.
void write_stamp(const std::string& path, const std::string& real_dir,
                 const std::map<std::string, Seen>& files) {
  const auto slash = path.find_last_of('/');
  if (!make_dirs(path.substr(0, slash))) return;
  nlohmann::json data = {{"bundle", real_dir}, {"files", nlohmann::json::object()}};
  for (const auto& [name, seen] : files)
    data["files"][name] = {{"size", seen.size}, {"mtime_ns", seen.mtime_ns},
                           {"sha256", seen.sha256}};
  const std::string text = data.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
  std::string tmp = path + ".XXXXXX";
  const int fd = mkstemp(tmp.data());
  if (fd < 0) return;
  bool ok = true;
  for (size_t done = 0; ok && done < text.size();) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    ok = n > 0;
    if (ok) done += size_t(n);
  }
  ok = ::close(fd) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) ::unlink(tmp.c_str());
}

// Each file of the manifest present and of its sha256; files the stamp vouches for are not
// hashed again (MTP_EDGE_VERIFY=always: all are).
void verify_files(const Manifest& m) {
  const auto real_dir = real_path(m.dir);
  const char* mode = std::getenv("MTP_EDGE_VERIFY");
  const bool always = mode && std::string(mode) == "always";
  const auto stamp = real_dir ? stamp_path(*real_dir) : std::nullopt;
  const auto stamped =
      stamp && !always ? read_stamp(*stamp, *real_dir) : std::map<std::string, Seen>();
  std::map<std::string, Seen> verified;
  bool hashed = false;
  for (const auto& [name, entry] : m.models) {
    const std::string file = m.dir + "/" + entry.file;
    if (is_dir(file)) {  // a Core ML .mlpackage: hashed every time, never stamped
      if (sha256_dir(file) != entry.sha256)
        throw UserError("bundle " + m.dir + ": " + entry.file +
                        " does not match its sha256 in manifest.json (modified or corrupted): "
                        "re-export the bundle");
      continue;
    }
    const auto before = seen_now(file);
    if (!before) throw UserError("bundle " + m.dir + " is missing " + entry.file + ": re-export it");
    const auto it = stamped.find(entry.file);
    if (it != stamped.end() && it->second.size == before->size &&
        it->second.mtime_ns == before->mtime_ns && it->second.sha256 == entry.sha256) {
      verified[entry.file] = it->second;
      continue;
    }
    hashed = true;
    std::string digest;
    try {
      digest = sha256_file(file);
    } catch (const std::runtime_error&) {
      throw UserError("bundle " + m.dir + ": cannot read " + entry.file + ": re-export it");
    }
    if (digest != entry.sha256)
      throw UserError("bundle " + m.dir + ": " + entry.file +
                      " does not match its sha256 in manifest.json (modified or corrupted): "
                      "re-export the bundle");
    const auto after = seen_now(file);  // changed while hashed: checked, but not stamped
    if (after && after->size == before->size && after->mtime_ns == before->mtime_ns)
      verified[entry.file] = {before->size, before->mtime_ns, digest};
  }
  if (stamp && hashed) write_stamp(*stamp, *real_dir, verified);
}

}  // namespace

std::string Manifest::path(const std::string& model) const {
  auto it = models.find(model);
  if (it == models.end()) throw UserError("bundle " + dir + " has no '" + model + "' file");
  return dir + "/" + it->second.file;
}

// The manifest's vocabulary and bos/eos ids against the hashed tokenizer_meta.json, as
// runtime/bundle.py checks them: an edited manifest is one line, not an id past the embedding.
static void check_against_tokenizer(const Manifest& m, const nlohmann::json& meta) {
  auto refuse = [&](const char* key, const std::string& said, const std::string& truth) {
    throw UserError("bundle " + m.dir + ": manifest.json says " + key + " is " + said + " but " +
                    "tokenizer_meta.json was exported with " + truth +
                    " (the manifest was edited): restore its manifest.json or re-export the "
                    "bundle");
  };
  if (meta.contains("vocab_size") && meta["vocab_size"].is_number_integer() &&
      meta["vocab_size"].get<int64_t>() != m.vocab_size)
    refuse("vocab_size", std::to_string(m.vocab_size), meta["vocab_size"].dump());
  if (meta.contains("bos_id") && (meta["bos_id"].is_null() || meta["bos_id"].is_number_integer())) {
    std::optional<int64_t> bos;
    if (!meta["bos_id"].is_null()) bos = meta["bos_id"].get<int64_t>();
    if (bos != m.bos_id)
      refuse("bos_id", m.bos_id ? std::to_string(*m.bos_id) : "null", meta["bos_id"].dump());
  }
  if (meta.contains("eos_ids") && meta["eos_ids"].is_array()) {
    std::vector<int64_t> said;  // the manifest's, repeats dropped as the tokenizer drops them
    for (int64_t id : m.eos_ids)
      if (std::find(said.begin(), said.end(), id) == said.end()) said.push_back(id);
    std::vector<int64_t> truth;
    for (const auto& id : meta["eos_ids"])
      if (id.is_number_integer()) truth.push_back(id.get<int64_t>());
    if (said != truth) refuse("eos_ids", nlohmann::json(m.eos_ids).dump(), meta["eos_ids"].dump());
  }
}

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
    check_keys(data, kManifestKeys, path, "");
    if (!data["models"].contains("target"))
      throw UserError(path + ": 'models' must map 'target' (and more) to files: re-export");
    m.platform = data["platform"].get<std::string>();
    m.backend = data["backend"].get<std::string>();
    m.model_name = data["model_name"].get<std::string>();
    m.max_seq_len = data["max_seq_len"].get<int64_t>();
    m.max_chunk = data["max_chunk"].get<int64_t>();
    m.vocab_size = data["vocab_size"].get<int64_t>();
    if (!data["bos_id"].is_null()) m.bos_id = data["bos_id"].get<int64_t>();
    m.eos_ids = data["eos_ids"].get<std::vector<int64_t>>();
    for (auto& [name, entry] : data["models"].items()) {
      check_keys(entry, kModelFileKeys, path + ": models." + name, "");
      m.models[name] = {entry["file"].get<std::string>(), entry["sha256"].get<std::string>(),
                        entry["quant"].value("attention", std::string()),
                        entry["quant"].value("scheme", std::string())};
      const nlohmann::json& quant = entry["quant"];
      if (quant.contains("group_size") && quant["group_size"].is_number_integer())
        m.models[name].group_size = quant["group_size"].get<int64_t>();
    }
    check_file_names(m, path);
    m.drafter = read_drafter(data["drafter"], path);
    m.has_chat_template = !data["chat_template"].is_null();
    if (data.contains("chat_format") && !data["chat_format"].is_null()) {
      const nlohmann::json& f = data["chat_format"];
      auto optional_text = [&f](const char* key) -> std::optional<std::string> {
        if (!f.contains(key)) return std::nullopt;
        return f[key].get<std::string>();
      };
      m.chat_format = ChatFormat{f.at("prefix").get<std::string>(),
                                 f.at("suffix").get<std::string>(), optional_text("next_turn"),
                                 optional_text("system_prefix"), optional_text("system_suffix")};
    }
  } catch (const nlohmann::json::exception& e) {
    throw UserError(path + " does not match the manifest schema (" + e.what() + ")");
  }
  check_links(m, path);
  if (verify) verify_files(m);
  // Read through its manifest entry, so that what is read is what was checked.
  const std::string meta = m.path("tokenizer_meta");
  if (is_file(meta)) {
    const nlohmann::json data = read_json(meta);
    if (!data.is_object() || (data.contains("add_bos") && !data["add_bos"].is_boolean()))
      throw UserError(meta + ": 'add_bos' must be true or false: re-export the bundle");
    m.add_bos = data.value("add_bos", false) && m.bos_id.has_value();
    check_against_tokenizer(m, data);
  }
  return m;
}

namespace {

struct Int8PathRow {
  const char* name;
  bool dot_product;
  int rows;
  int blockwise_rows;
  std::vector<std::string> needs;  // the /proc/cpuinfo flags that make it this CPU's
};

const std::vector<Int8PathRow>& int8_paths() {
  static const std::vector<Int8PathRow> rows = {
      {"avx512-vnni", true, 5, 0, {"avx512_vnni"}},
      {"avx-vnni", true, 5, 0, {"avx_vnni"}},
      {"avx512", false, 8, 0, {"avx512f", "avx512bw"}},
      {"avx2", false, 4, 3, {"avx2"}},
      {"sse4", false, 4, 0, {"sse4_1"}},
      {"sme", true, 4, 0, {"sme", "i8mm"}},
      {"i8mm", true, 4, 0, {"i8mm"}},
      {"neon-dot", true, 4, 0, {"asimddp"}},
      {"neon", false, 0, 0, {"asimd"}},
      {"unknown", false, 0, 0, {}},
  };
  return rows;
}

std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

}  // namespace

Int8Path host_int8_path() {
  const auto& rows = int8_paths();
  std::string name = "unknown";
  const char* given = std::getenv("MTP_EDGE_INT8_PATH");
  if (given != nullptr && *given != '\0') {
    name = given;
    if (std::none_of(rows.begin(), rows.end(), [&](const Int8PathRow& r) { return name == r.name; })) {
      std::string names;
      for (const auto& r : rows) names += (names.empty() ? "" : ", ") + std::string(r.name);
      throw UserError("MTP_EDGE_INT8_PATH=" + name + " is not an int8 path: use one of " + names +
                      ", or unset it to read the CPU's flags");
    }
  } else {
    std::ifstream cpuinfo("/proc/cpuinfo");
    std::vector<std::string> flags;
    std::string line;
    while (std::getline(cpuinfo, line)) {
      const auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      std::string key = lower(line.substr(0, colon));
      key.erase(key.find_last_not_of(" \t") + 1);
      key.erase(0, key.find_first_not_of(" \t"));
      if (key != "flags" && key != "features") continue;
      std::istringstream words(lower(line.substr(colon + 1)));
      for (std::string word; words >> word;) flags.push_back(word);
    }
    auto has = [&flags](const std::string& flag) {
      return std::find(flags.begin(), flags.end(), flag) != flags.end();
    };
    for (const auto& r : rows) {
      if (!r.needs.empty() && std::all_of(r.needs.begin(), r.needs.end(), has)) {
        name = r.name;
        break;
      }
    }
  }
  for (const auto& r : rows)
    if (name == r.name) return {r.name, r.dot_product, r.rows, r.blockwise_rows};
  return {"unknown", false, 0, 0};
}

std::string Manifest::target_scheme() const {
  const auto target = models.find("target");
  return target == models.end() ? std::string() : target->second.scheme;
}

int64_t Manifest::k_for_this_cpu() const {
  const int64_t k = drafter.k;
  const auto target = models.find("target");
  if (backend != "executorch" || target == models.end()) return k;
  // 8da8w-avx2 and 8da4w-mix-avx2 run our own kernels (int8_linear.cpp), 6 rows a pass on
  // every CPU.
  if (own_kernels()) return std::min<int64_t>(k, 5);
  const int rows = tile_rows();
  if (rows == 0 || k + 1 <= rows) return k;
  return std::max<int64_t>(1, rows - 1);
}

bool Manifest::own_kernels() const {
  const std::string scheme = target_scheme();
  return scheme == "8da8w-avx2" || scheme == "8da4w-mix-avx2";
}

int Manifest::tile_rows() const {
  const auto target = models.find("target");
  if (backend != "executorch" || target == models.end()) return 0;
  const std::string& scheme = target->second.scheme;
  const bool grouped = target->second.group_size > 0;
  if (scheme != "8da8w" && scheme != "8da4w" && scheme != "8da4w-mix") return 0;
  const Int8Path path = host_int8_path();
  if (path.dot_product) return 0;
  return scheme != "8da8w" && grouped ? path.blockwise_rows : path.rows;
}

}  // namespace mtp
