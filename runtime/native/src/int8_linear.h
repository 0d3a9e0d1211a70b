#pragma once

namespace mtp {

// Registers our linear kernels, mtp_edge::linear_i8.out (8da8w weights), linear_i4.out and
// linear_i6.out (4- and 6-bit weights in groups of 32), all packed for a 6-row tile
// (runtime/native/src/int8_linear.cpp), unless already registered. register_mtp_ops calls it.
void register_int8_linear();

}  // namespace mtp
