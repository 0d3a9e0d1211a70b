#include "request_log.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <utility>

#include "errors.h"

namespace mtp {

namespace fs = std::filesystem;

std::vector<std::string> log_files(const std::string& log) {
  std::error_code error;
  if (!fs::is_directory(log, error)) return {log};
  std::vector<std::pair<int64_t, std::string>> found;
  for (const auto& entry : fs::directory_iterator(log, error)) {
    const std::string name = entry.path().filename().string();
    const std::string head = "requests", tail = ".jsonl";
    if (name.size() < head.size() + tail.size() || name.compare(0, head.size(), head) != 0 ||
        name.compare(name.size() - tail.size(), tail.size(), tail) != 0)
      continue;
    const std::string middle = name.substr(head.size(), name.size() - head.size() - tail.size());
    if (middle.empty()) {
      found.emplace_back(0, entry.path().string());
    } else if (middle.size() > 1 && middle[0] == '.' &&
               middle.find_first_not_of("0123456789", 1) == std::string::npos &&
               middle.size() < 19) {
      found.emplace_back(std::stoll(middle.substr(1)), entry.path().string());
    }
  }
  std::sort(found.begin(), found.end(), std::greater<>());
  std::vector<std::string> files;
  for (const auto& [n, path] : found) files.push_back(path);
  return files;
}

namespace {

// Holds an open file descriptor and, once locked, an exclusive flock on it.
class Locked {
 public:
  explicit Locked(const std::string& path)
      : fd_(::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600)) {}
  ~Locked() {
    if (fd_ >= 0) ::close(fd_);  // closing releases the lock
  }
  Locked(const Locked&) = delete;
  Locked& operator=(const Locked&) = delete;
  bool ok() const { return fd_ >= 0; }
  bool lock() const { return ::flock(fd_, LOCK_EX) == 0; }

 private:
  int fd_;
};

std::string now_utc() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

}  // namespace

RequestLog::RequestLog(std::string directory, int64_t file_bytes, int64_t keep)
    : directory_(std::move(directory)), file_bytes_(file_bytes), keep_(keep) {
  if (directory_.empty()) throw UserError("a request log needs a folder");
  if (file_bytes_ < 1024 || keep_ < 0)
    throw UserError("a request log needs file_bytes >= 1024 and keep >= 0");
  std::error_code error;
  fs::create_directories(directory_, error);
  Locked probe(directory_ + "/.lock");
  if (error || !probe.ok())
    throw UserError("cannot write the request log in " + directory_ + ": " +
                    (error ? error.message() : std::strerror(errno)) +
                    ": give it a folder the app can write");
}

std::string RequestLog::path(int64_t n) const {
  return directory_ + (n == 0 ? "/requests.jsonl" : "/requests." + std::to_string(n) + ".jsonl");
}

void RequestLog::rotate() const {
  std::error_code error;
  if (keep_ == 0) {
    fs::remove(path(0), error);
    return;
  }
  fs::remove(path(keep_), error);
  for (int64_t n = keep_ - 1; n >= 0; --n)
    if (fs::exists(path(n), error)) fs::rename(path(n), path(n + 1), error);
}

void RequestLog::append(const nlohmann::ordered_json& messages, const std::vector<int64_t>& answer_ids,
                        double tau, const std::string& finish_reason, const std::string& model) {
  // In mtp_edge/request_log.py's order of keys.
  const nlohmann::ordered_json record = {{"time", now_utc()},
                                 {"model", model},
                                 {"messages", messages},
                                 {"answer_ids", answer_ids},
                                 {"finish_reason", finish_reason},
                                 {"tau", std::round(tau * 1e4) / 1e4}};
  // Invalid UTF-8 in a message (the C API takes bytes) is written as U+FFFD, not refused.
  const std::string line =
      record.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
  Locked lock(directory_ + "/.lock");
  if (!lock.ok() || !lock.lock())
    throw UserError("cannot lock the request log in " + directory_ + ": " +
                    std::strerror(errno));
  std::error_code error;
  const auto size = fs::file_size(path(0), error);
  if (!error && size > 0 && int64_t(size + line.size()) > file_bytes_) rotate();
  const int fd = ::open(path(0).c_str(), O_RDWR | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0)
    throw UserError("cannot write the request log " + path(0) + ": " + std::strerror(errno));
  struct stat before {};
  const bool sized = ::fstat(fd, &before) == 0;
  // A record torn by a writer killed mid-append must not glue onto this one: start on a
  // fresh line when the file does not end with one.
  std::string out = line;
  if (sized && before.st_size > 0) {
    char tail = '\n';
    if (::pread(fd, &tail, 1, before.st_size - 1) == 1 && tail != '\n') out.insert(0, "\n");
  }
  const ssize_t written = ::write(fd, out.data(), out.size());
  const int saved = errno;
  // A short write (a full disk) is taken back: no reader ever meets half a line mid-file.
  if (written != ssize_t(out.size()) && written > 0 && sized) {
    if (::ftruncate(fd, before.st_size) != 0) { /* the reader skips a torn line */ }
  }
  ::close(fd);
  if (written != ssize_t(out.size()))
    throw UserError("cannot write the request log " + path(0) + ": " +
                    (written < 0 ? std::strerror(saved) : "short write (disk full?)"));
}

}  // namespace mtp
