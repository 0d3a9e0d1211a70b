// SHA-256 (FIPS 180-4), small and dependency-free: the runtime checks bundle files against the
// hashes in manifest.json, and pulling in OpenSSL for that would burden the Android build.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mtp {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t size);
  std::string hex_digest();  // finishes the hash; call once

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
};

std::string sha256_hex(const std::string& data);
std::string sha256_file(const std::string& path);  // throws std::runtime_error if unreadable

}  // namespace mtp
