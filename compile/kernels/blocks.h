// Block-quantized linear layers, y = x W^T, with W read exactly as a GGUF file stores it: Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0 (blocks of 32 weights along K) and Q4_K, Q5_K, Q6_K (super-blocks of 256).
//
// Row-independent by construction: each output row is a function of its own activation row alone, computed
// by the same instructions in the same order whatever M is and whatever the other rows hold. Activations are
// quantized to int8 per row and block of 32 (scale amax/127), block dot products are exact integers, and the
// float accumulation runs over blocks in index order. A verify row therefore gets the bits a decode step gets
// for the same token, which makes greedy speculation lossless on this path.
//
// Every format is one weight per code, value = code - offset, times a per-column float scale of its block (of
// its half block for Q6_K, whose sub-blocks hold 16), plus a per-column float minimum of the block for the
// formats that have one. Those scales are the file's: fp16 d (and m) per block, or fp16 d (and dmin) per
// super-block times the block's integer scale (and minimum), products that float32 holds exactly. Nothing is
// re-rounded: dequantizing the layout gives gguf's own dequantization, bit for bit.
//
// Layout (written by compile/kernels/formats.py), per tile of 16 output columns and block of 32 along K, one
// record of `record` bytes, records [N/16][K/32]:
//   codes, for column c of the tile, g in 0..3, i in 0..3 (k = 4g+i is the low half, 16+4g+i the high half):
//     4 bits: 256 bytes; byte 64g + 4c + i holds code(c, 4g+i) & 15 (low nibble), code(c, 16+4g+i) & 15 (high),
//             so one 64-byte load feeds 16 columns' 4-wide u8 x s8 dot products (vpdpbusd) twice;
//     5 bits: those 256, then 64 bytes; bit g of byte 4c+i is code(c, 4g+i) >> 4, bit 4+g code(c, 16+4g+i) >> 4;
//     6 bits: those 256, then 64 bytes with bits 2g..2g+1 of byte 4c+i = code(c, 4g+i) >> 4, then 64 with the
//             high half's;
//     8 bits: 512 bytes, byte 64g + 4c + i = code(c, 4g+i), byte 256 + 64g + 4c + i = code(c, 16+4g+i)
//             (Q8_0's codes are its signed bytes);
//   then the block's parameters, per column: Q4_0, Q5_0, Q8_0: d fp16[16]; Q4_1, Q5_1: d fp16[16], m fp16[16];
//   Q4_K, Q5_K: scale u8[16], min u8[16]; Q6_K: scale int8[16] of the low half, int8[16] of the high half;
// and, for the K-quants, per tile and super-block of 8 blocks, `super` bytes, super [N/16][K/256]: d fp16[16]
// (Q6_K), or d fp16[16] and dmin fp16[16] (Q4_K, Q5_K).
//
// F16 and F32 (tensors a quantized file keeps in float, or holds in a type these kernels do not read, dequantized
// exactly) are records of 32 rows of K, k-major: value (c, k) at index 16k + c. Their product accumulates x[k] *
// w[k] over k in order per row and column, in float32, so it is row-independent too.
#pragma once
#include <cstddef>
#include <cstdint>

namespace specair {

constexpr int kBlock = 32;
constexpr int kTile = 16;
constexpr int kSuper = 8;  // blocks per super-block

enum Format : int { kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kF16, kF32, kFormatCount };

struct FormatInfo {
  const char* name;  // GGML's name of the type
  int bits;          // bits per code
  int record;        // bytes per tile and block
  int super;         // bytes per tile and super-block (0: none)
};

const FormatInfo& format_info(int format);
int format_by_name(const char* name);  // -1 for a name that is not a format

// Activations of M rows quantized per block: q8 [M][K], scale and float sum [M][K/32], integer sums of q8
// over each half block [M][K/32][2].
struct Q8Rows {
  const int8_t* q;
  const float* scale;
  const float* sum;
  const int32_t* isum;
};

// The instruction set the kernels use on this CPU ("avx512vnni", "avxvnni", "avx2", "portable").
const char* blocks_isa();

// x [M][K] -> q8 [M][K], scale and sum [M][K/32], isum [M][K/32][2].
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q8, float* scale, float* sum, int32_t* isum);

// Whether a format holds float weights (F16, F32): its product reads the activations as they are.
bool is_float(int format);

// y[m][n] for column tiles [tile_begin, tile_end), every row; y has row stride N. x: the activations quantized
// (quantize_rows) for block formats, xf [M][K] as they are for float formats.
void blocks_tiles(int format, const Q8Rows& x, const float* xf, int64_t M, int64_t K, int64_t N,
                  const uint8_t* records, const uint8_t* super, float* y, int64_t tile_begin, int64_t tile_end);

// The weights the layout holds, w [N][K] in float32.
void blocks_dequantize(int format, int64_t K, int64_t N, const uint8_t* records, const uint8_t* super, float* w);

// Row n of those weights, w [K]: what blocks_dequantize gives for it, bit for bit.
void blocks_row(int format, int64_t K, const uint8_t* records, const uint8_t* super, int64_t n, float* w);

}  // namespace specair
