// Q4_1 int4 linear layer, y = x W^T with W = d * q + m per block of 32 weights along K (GGUF Q4_1's blocks).
//
// Row-independent by construction: each output row is a function of its own activation row alone, computed
// by the same instructions in the same order whatever M is and whatever the other rows hold. Activations are
// quantized to int8 per row and block (llama.cpp's Q8 for Q4_1), block dot products are exact integers, and
// the float accumulation runs over blocks in index order. A verify row therefore gets the bits a decode step
// gets for the same token, which makes greedy speculation lossless on this path.
//
// Weight layout (written by compile/quantize.py), per tile of 16 output columns and block of 32 along K:
//   packed [N/16][K/32][256] bytes: byte 64*g + 4*c + i holds q[c][4g+i] (low nibble) and q[c][16+4g+i]
//   (high nibble) for column c of the tile, g in 0..3, i in 0..3 -- so one 64-byte load feeds 16 columns'
//   4-wide u8 x s8 dot products (vpdpbusd) twice;
//   scales and mins [N/16][K/32][16] IEEE half floats, as GGUF stores a Q4_1 block's d and m.
#pragma once
#include <cstddef>
#include <cstdint>

namespace specair {

constexpr int kBlock = 32;
constexpr int kTile = 16;

// Activations of M rows quantized per block: q8 [M][K], scale and float sum [M][K/32].
struct Q8Rows {
  const int8_t* q;
  const float* scale;
  const float* sum;
};

// The instruction set the kernels use on this CPU ("avx512vnni", "avx2", "portable").
const char* q4_1_isa();

// x [M][K] -> q8 [M][K], scale and sum [M][K/32].
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q8, float* scale, float* sum);

// y[m][n] for column tiles [tile_begin, tile_end), every row; y has row stride N.
void q4_1_tiles(const Q8Rows& x, int64_t M, int64_t K, int64_t N, const uint8_t* packed, const uint16_t* scales,
                const uint16_t* mins, float* y, int64_t tile_begin, int64_t tile_end);

}  // namespace specair
