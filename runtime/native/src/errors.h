#pragma once

#include <stdexcept>
#include <string>

namespace mtp {

// A problem the user can fix (bad bundle, bad option): printed as one `error: ...` line.
struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace mtp
