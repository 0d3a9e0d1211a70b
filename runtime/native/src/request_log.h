// Request logs on the device: the requests an app serves, kept in its own storage so that the
// store of past requests (answer_store.h) starts from them after a restart, and so that the
// heads can be refined on them (`mtp-train --init HEADS --prompts LOG`). The format and the
// bounds are mtp_edge/request_log.py's, so either side reads what the other wrote.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mtp {

// A log folder's files, oldest first (mtp_edge/request_log.py log_files): requests.N.jsonl by
// N descending, then requests.jsonl; a path that is not a folder is itself.
std::vector<std::string> log_files(const std::string& log);

// Appends one JSON line per request to DIR/requests.jsonl:
//   {"time", "model", "messages", "answer_ids", "finish_reason", "tau"}
// When the file would pass file_bytes it becomes requests.1.jsonl (older files shift up) and
// files beyond `keep` are deleted: the folder holds at most about (keep + 1) x file_bytes.
// Each line is one write(2) under an exclusive lock of DIR/.lock, shared with Python writers of
// the same folder. Not thread-safe: the C API's calls on one engine do not overlap.
class RequestLog {
 public:
  static constexpr int64_t kFileBytes = 8 << 20;
  static constexpr int64_t kKeep = 4;
  // Throws UserError, one line, when the folder cannot be made or written, or the bounds are
  // out of range (file_bytes >= 1024, keep >= 0).
  RequestLog(std::string directory, int64_t file_bytes = kFileBytes, int64_t keep = kKeep);

  void append(const nlohmann::ordered_json& messages, const std::vector<int64_t>& answer_ids, double tau,
              const std::string& finish_reason, const std::string& model);

  const std::string& directory() const { return directory_; }
  int64_t file_bytes() const { return file_bytes_; }
  int64_t keep() const { return keep_; }

 private:
  std::string path(int64_t n) const;
  void rotate() const;

  std::string directory_;
  int64_t file_bytes_;
  int64_t keep_;
};

}  // namespace mtp
