#pragma once

namespace mtp {

// Registers our int8 linear kernel, mtp_edge::linear_i8.out (8da8w weights packed for a 6-row
// tile; runtime/native/src/int8_linear.cpp), unless already registered. register_mtp_ops calls
// it.
void register_int8_linear();

}  // namespace mtp
