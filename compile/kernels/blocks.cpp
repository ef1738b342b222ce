// Block-quantized linear kernels: AVX-512 VNNI, AVX2 (AVX-VNNI where present) and portable, picked once by CPU.
// See blocks.h for the layout and why every path is row-independent.
#include "blocks.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace specair {
namespace {

constexpr int kRows = 4;  // rows per register chunk

enum Scale { kPerBlock, kPerBlockMin, kSuperMin, kSuperHalves };

// bits: code width; offset: subtracted from every code (Q8_0's signed codes: see `kSigned`); scale: what a
// block's per-column parameters are.
template <int F> struct Fmt;
template <> struct Fmt<kQ4_0> { static constexpr int bits = 4, offset = 8, scale = kPerBlock; };
template <> struct Fmt<kQ4_1> { static constexpr int bits = 4, offset = 0, scale = kPerBlockMin; };
template <> struct Fmt<kQ5_0> { static constexpr int bits = 5, offset = 16, scale = kPerBlock; };
template <> struct Fmt<kQ5_1> { static constexpr int bits = 5, offset = 0, scale = kPerBlockMin; };
template <> struct Fmt<kQ8_0> { static constexpr int bits = 8, offset = 0, scale = kPerBlock; };
template <> struct Fmt<kQ4_K> { static constexpr int bits = 4, offset = 0, scale = kSuperMin; };
template <> struct Fmt<kQ5_K> { static constexpr int bits = 5, offset = 0, scale = kSuperMin; };
template <> struct Fmt<kQ6_K> { static constexpr int bits = 6, offset = 32, scale = kSuperHalves; };

constexpr int code_bytes(int bits) { return bits == 8 ? 512 : bits == 6 ? 384 : bits == 5 ? 320 : 256; }
constexpr int param_bytes(int scale) { return scale == kPerBlockMin ? 64 : 32; }
constexpr int super_bytes(int scale) { return scale == kSuperMin ? 64 : scale == kSuperHalves ? 32 : 0; }
template <int F> constexpr int kRecord = code_bytes(Fmt<F>::bits) + param_bytes(Fmt<F>::scale);
template <int F> constexpr int kSuperBytes = super_bytes(Fmt<F>::scale);
// Q8_0's codes are signed bytes. u8 x s8 products (vpdpbusd) take them shifted by 128 (xor 0x80), the offset
// then taken back with the activations' integer sum; without VNNI they are multiplied signed directly.
template <int F> constexpr bool kSigned = F == kQ8_0;

const FormatInfo kInfo[kFormatCount] = {
    {"Q4_0", 4, kRecord<kQ4_0>, kSuperBytes<kQ4_0>}, {"Q4_1", 4, kRecord<kQ4_1>, kSuperBytes<kQ4_1>},
    {"Q5_0", 5, kRecord<kQ5_0>, kSuperBytes<kQ5_0>}, {"Q5_1", 5, kRecord<kQ5_1>, kSuperBytes<kQ5_1>},
    {"Q8_0", 8, kRecord<kQ8_0>, kSuperBytes<kQ8_0>}, {"Q4_K", 4, kRecord<kQ4_K>, kSuperBytes<kQ4_K>},
    {"Q5_K", 5, kRecord<kQ5_K>, kSuperBytes<kQ5_K>}, {"Q6_K", 6, kRecord<kQ6_K>, kSuperBytes<kQ6_K>},
    {"F16", 16, 2 * kBlock * kTile, 0}, {"F32", 32, 4 * kBlock * kTile, 0},
};

inline float half_to_float(uint16_t h) {  // IEEE binary16, exactly (subnormals included)
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  float f;
  if (exp == 0x1Fu) {
    const uint32_t bits = sign | 0x7F800000u | (man << 13);
    std::memcpy(&f, &bits, sizeof f);
  } else if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -24);
    if (sign) f = -f;
  } else {
    const uint32_t bits = sign | ((exp + 112u) << 23) | (man << 13);
    std::memcpy(&f, &bits, sizeof f);
  }
  return f;
}

inline uint16_t load_half(const uint8_t* p, int i) {
  uint16_t h;
  std::memcpy(&h, p + 2 * i, sizeof h);
  return h;
}

// Code of column c, element k (0..31) of a block record, as the unsigned code (Q8_0: the signed byte).
template <int F>
inline int code_at(const uint8_t* w, int c, int k) {
  constexpr int bits = Fmt<F>::bits;
  const int half = k >> 4, g = (k & 15) >> 2, i = k & 3, p = 4 * c + i;
  if constexpr (bits == 8) {
    const uint8_t byte = w[256 * half + 64 * g + p];
    return kSigned<F> ? static_cast<int>(static_cast<int8_t>(byte)) : byte;
  } else {
    int code = (w[64 * g + p] >> (4 * half)) & 15;
    if constexpr (bits == 5) code |= ((w[256 + p] >> (g + 4 * half)) & 1) << 4;
    if constexpr (bits == 6) code |= ((w[256 + 64 * half + p] >> (2 * g)) & 3) << 4;
    return code;
  }
}

// The float scales of column c in block b: ws[0] for the low half, ws[1] for the high half, and the minimum.
template <int F>
inline void column_scales(const uint8_t* w, const uint8_t* sup, int c, float* ws, float* wm) {
  const uint8_t* p = w + code_bytes(Fmt<F>::bits);
  *wm = 0.0f;
  if constexpr (Fmt<F>::scale == kPerBlock) {
    ws[0] = ws[1] = half_to_float(load_half(p, c));
  } else if constexpr (Fmt<F>::scale == kPerBlockMin) {
    ws[0] = ws[1] = half_to_float(load_half(p, c));
    *wm = half_to_float(load_half(p + 32, c));
  } else if constexpr (Fmt<F>::scale == kSuperMin) {
    ws[0] = ws[1] = half_to_float(load_half(sup, c)) * static_cast<float>(p[c]);
    *wm = -(half_to_float(load_half(sup + 32, c)) * static_cast<float>(p[16 + c]));
  } else {
    const float d = half_to_float(load_half(sup, c));
    ws[0] = d * static_cast<float>(static_cast<int8_t>(p[c]));
    ws[1] = d * static_cast<float>(static_cast<int8_t>(p[16 + c]));
  }
}

inline float block_scale(float amax) { return amax / 127.0f; }
inline float block_inverse(float amax) { return amax > 0.0f ? 127.0f / amax : 0.0f; }

void quantize_portable(const float* x, int64_t M, int64_t K, int8_t* q8, float* scale, float* sum, int32_t* isum) {
  const int64_t nb = K / kBlock;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + r * K + b * kBlock;
      int8_t* q = q8 + r * K + b * kBlock;
      float amax = 0.0f, s = 0.0f;
      for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
      for (int i = 0; i < kBlock; ++i) s += v[i];
      const float inv = block_inverse(amax);
      int32_t h[2] = {0, 0};
      for (int i = 0; i < kBlock; ++i) {
        q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(v[i] * inv), -127.0f, 127.0f));
        h[i >> 4] += q[i];
      }
      scale[r * nb + b] = block_scale(amax);
      sum[r * nb + b] = s;
      isum[2 * (r * nb + b)] = h[0];
      isum[2 * (r * nb + b) + 1] = h[1];
    }
  }
}

// The portable path: the same integers and the same float operations, in the same order, as the SIMD paths.
template <int F>
void tiles_portable(const Q8Rows& x, int64_t M, int64_t K, int64_t N, const uint8_t* rec, const uint8_t* sup,
                    float* y, int64_t t0, int64_t t1) {
  using T = Fmt<F>;
  const int64_t nb = K / kBlock, nsb = nb / kSuper;
  for (int64_t t = t0; t < t1; ++t) {
    for (int c = 0; c < kTile; ++c) {
      const int64_t n = t * kTile + c;
      if (n >= N) break;
      for (int64_t r = 0; r < M; ++r) {
        const int8_t* xq = x.q + r * K;
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* w = rec + (t * nb + b) * kRecord<F>;
          const uint8_t* s = kSuperBytes<F> ? sup + (t * nsb + b / kSuper) * kSuperBytes<F> : nullptr;
          int32_t dot[2] = {0, 0};
          for (int k = 0; k < kBlock; ++k) dot[k >> 4] += code_at<F>(w, c, k) * xq[b * kBlock + k];
          const int64_t rb = r * nb + b;
          if constexpr (T::offset != 0) {
            dot[0] -= T::offset * x.isum[2 * rb];
            dot[1] -= T::offset * x.isum[2 * rb + 1];
          }
          float ws[2], wm;
          column_scales<F>(w, s, c, ws, &wm);
          const float dx = x.scale[rb];
          if constexpr (T::scale == kSuperHalves) {
            acc = std::fma(static_cast<float>(dot[0]), ws[0] * dx, acc);
            acc = std::fma(static_cast<float>(dot[1]), ws[1] * dx, acc);
          } else {
            acc = std::fma(static_cast<float>(dot[0] + dot[1]), ws[0] * dx, acc);
          }
          if constexpr (T::scale == kPerBlockMin || T::scale == kSuperMin) acc = std::fma(wm, x.sum[rb], acc);
        }
        y[r * N + n] = acc;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------- AVX-512

#define SPECAIR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq")))

SPECAIR_AVX512
void quantize_avx512(const float* x, int64_t M, int64_t K, int8_t* q8, float* scale, float* sum, int32_t* isum) {
  const int64_t nb = K / kBlock;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + r * K + b * kBlock;
      const __m512 a = _mm512_loadu_ps(v), c = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
      const __m512 inv = _mm512_set1_ps(block_inverse(amax));
      // cvtps rounds to nearest even, as nearbyint does in the portable path; clamped to +-127 as there.
      const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
      const __m512i qa = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), top), bottom);
      const __m512i qc = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(c, inv)), top), bottom);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + r * K + b * kBlock), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + r * K + b * kBlock + 16), _mm512_cvtsepi32_epi8(qc));
      scale[r * nb + b] = block_scale(amax);
      sum[r * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
      isum[2 * (r * nb + b)] = _mm512_reduce_add_epi32(qa);
      isum[2 * (r * nb + b) + 1] = _mm512_reduce_add_epi32(qc);
    }
  }
}

// a | (b & mask) in one operation
SPECAIR_AVX512 inline __m512i or_masked(__m512i a, __m512i b, __m512i mask) {
  return _mm512_ternarylogic_epi32(a, b, mask, 0xF8);
}

// A block's 16 columns of codes as u8 vectors: lo[g] holds k = 4g..4g+3, hi[g] k = 16+4g..16+4g+3, per column.
template <int F>
SPECAIR_AVX512 inline void codes512(const uint8_t* w, __m512i* lo, __m512i* hi) {
  constexpr int bits = Fmt<F>::bits;
  if constexpr (bits == 8) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int g = 0; g < 4; ++g) {
      lo[g] = _mm512_xor_si512(_mm512_loadu_si512(w + 64 * g), flip);
      hi[g] = _mm512_xor_si512(_mm512_loadu_si512(w + 256 + 64 * g), flip);
    }
  } else {
    const __m512i low = _mm512_set1_epi8(15), high = _mm512_set1_epi8(static_cast<char>(0xF0));
    for (int g = 0; g < 4; ++g) {
      const __m512i v = _mm512_loadu_si512(w + 64 * g);
      lo[g] = _mm512_and_si512(v, low);
      // 4-bit codes: the high nibbles stay in place, 16x the code (the dot product is shifted back, exactly);
      // one operation fewer per vector
      hi[g] = bits == 4 ? _mm512_and_si512(v, high) : _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    if constexpr (bits == 5) {  // bit g (low half) and 4+g (high half) of each byte, moved to bit 4
      const __m512i h = _mm512_loadu_si512(w + 256), b4 = _mm512_set1_epi8(0x10);
      lo[0] = or_masked(lo[0], _mm512_slli_epi16(h, 4), b4);
      lo[1] = or_masked(lo[1], _mm512_slli_epi16(h, 3), b4);
      lo[2] = or_masked(lo[2], _mm512_slli_epi16(h, 2), b4);
      lo[3] = or_masked(lo[3], _mm512_slli_epi16(h, 1), b4);
      hi[0] = or_masked(hi[0], h, b4);
      hi[1] = or_masked(hi[1], _mm512_srli_epi16(h, 1), b4);
      hi[2] = or_masked(hi[2], _mm512_srli_epi16(h, 2), b4);
      hi[3] = or_masked(hi[3], _mm512_srli_epi16(h, 3), b4);
    }
    if constexpr (bits == 6) {  // bits 2g, 2g+1 of each byte, moved to bits 4, 5
      const __m512i b45 = _mm512_set1_epi8(0x30);
      __m512i* halves[2] = {lo, hi};
      for (int half = 0; half < 2; ++half) {
        const __m512i h = _mm512_loadu_si512(w + 256 + 64 * half);
        __m512i* v = halves[half];
        v[0] = or_masked(v[0], _mm512_slli_epi16(h, 4), b45);
        v[1] = or_masked(v[1], _mm512_slli_epi16(h, 2), b45);
        v[2] = or_masked(v[2], h, b45);
        v[3] = or_masked(v[3], _mm512_srli_epi16(h, 2), b45);
      }
    }
  }
}

// 16 float16, unsigned or signed bytes as float32.
SPECAIR_AVX512 inline __m512 half16(const uint8_t* q) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
}
SPECAIR_AVX512 inline __m512 u8x16(const uint8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}
SPECAIR_AVX512 inline __m512 i8x16(const uint8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}

// The block's per-column float scales (ws0 low half, ws1 high half) and minima, as column_scales computes them,
// except that the minimum is not negated (its product is subtracted instead, which rounds the same). The
// K-quants' super-block d and dmin (sd, sm) are converted once per super-block by the caller.
template <int F>
SPECAIR_AVX512 inline void scales512(const uint8_t* w, __m512 sd, __m512 sm, __m512& ws0, __m512& ws1, __m512& wm) {
  const uint8_t* p = w + code_bytes(Fmt<F>::bits);
  if constexpr (Fmt<F>::scale == kPerBlock) {
    ws0 = ws1 = half16(p);
  } else if constexpr (Fmt<F>::scale == kPerBlockMin) {
    ws0 = ws1 = half16(p);
    wm = half16(p + 32);
  } else if constexpr (Fmt<F>::scale == kSuperMin) {
    ws0 = ws1 = _mm512_mul_ps(sd, u8x16(p));
    wm = _mm512_mul_ps(sm, u8x16(p + 16));
  } else {
    ws0 = _mm512_mul_ps(sd, i8x16(p));
    ws1 = _mm512_mul_ps(sd, i8x16(p + 16));
  }
}

template <int F>
SPECAIR_AVX512 void tiles_avx512(const Q8Rows& x, int64_t M, int64_t K, int64_t N, const uint8_t* rec,
                                 const uint8_t* sup, float* y, int64_t t0, int64_t t1) {
  using T = Fmt<F>;
  constexpr int R = kRecord<F>, S = kSuperBytes<F>;
  constexpr int offset = kSigned<F> ? 128 : T::offset;
  const int64_t nb = K / kBlock, nsb = nb / kSuper;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * kTile;
    const __mmask16 keep = N - n0 >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << (N - n0)) - 1);
    for (int64_t r0 = 0; r0 < M; r0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - r0));
      __m512 acc[kRows], sd = _mm512_setzero_ps(), sm = _mm512_setzero_ps();
      for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t tb = t * nb + b;
        const uint8_t* w = rec + tb * R;
        if (S && b % kSuper == 0) {
          const uint8_t* s = sup + (t * nsb + b / kSuper) * S;
          sd = half16(s);
          if constexpr (T::scale == kSuperMin) sm = half16(s + 32);
        }
        __m512i lo[4], hi[4];
        codes512<F>(w, lo, hi);
        __m512 ws0, ws1, wm = _mm512_setzero_ps();
        scales512<F>(w, sd, sm, ws0, ws1, wm);
        for (int r = 0; r < kRows; ++r) {
          if (r >= rows) break;
          const int32_t* xq = reinterpret_cast<const int32_t*>(x.q + (r0 + r) * K + b * kBlock);
          __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
          for (int g = 0; g < 4; ++g) {
            s0 = _mm512_dpbusd_epi32(s0, lo[g], _mm512_set1_epi32(xq[g]));
            s1 = _mm512_dpbusd_epi32(s1, hi[g], _mm512_set1_epi32(xq[4 + g]));
          }
          if constexpr (T::bits == 4) s1 = _mm512_srai_epi32(s1, 4);  // an exact multiple of 16 (codes512)
          const int64_t rb = (r0 + r) * nb + b;
          if constexpr (offset != 0) {
            s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(offset * x.isum[2 * rb]));
            s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(offset * x.isum[2 * rb + 1]));
          }
          const __m512 dx = _mm512_set1_ps(x.scale[rb]);
          if constexpr (T::scale == kSuperHalves) {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(ws0, dx), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(ws1, dx), acc[r]);
          } else {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(ws0, dx), acc[r]);
          }
          if constexpr (T::scale == kPerBlockMin)
            acc[r] = _mm512_fmadd_ps(wm, _mm512_set1_ps(x.sum[rb]), acc[r]);
          if constexpr (T::scale == kSuperMin)
            acc[r] = _mm512_fnmadd_ps(wm, _mm512_set1_ps(x.sum[rb]), acc[r]);
        }
      }
      for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * N + n0, keep, acc[r]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------- AVX2

#define SPECAIR_AVX2 __attribute__((target("avx2,fma,f16c,avxvnni")))

SPECAIR_AVX2 inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Columns 8h..8h+7 of a block: as codes512, 32 bytes each.
template <int F>
SPECAIR_AVX2 inline void codes256(const uint8_t* w, int h, __m256i* lo, __m256i* hi) {
  constexpr int bits = Fmt<F>::bits;
  const int o = 32 * h;
  if constexpr (bits == 8) {
    for (int g = 0; g < 4; ++g) {
      lo[g] = load256(w + 64 * g + o);
      hi[g] = load256(w + 256 + 64 * g + o);
    }
  } else {
    const __m256i low = _mm256_set1_epi8(15);
    for (int g = 0; g < 4; ++g) {
      const __m256i v = load256(w + 64 * g + o);
      lo[g] = _mm256_and_si256(v, low);
      hi[g] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    if constexpr (bits == 5) {
      const __m256i q = load256(w + 256 + o), b4 = _mm256_set1_epi8(0x10);
      lo[0] = _mm256_or_si256(lo[0], _mm256_and_si256(_mm256_slli_epi16(q, 4), b4));
      lo[1] = _mm256_or_si256(lo[1], _mm256_and_si256(_mm256_slli_epi16(q, 3), b4));
      lo[2] = _mm256_or_si256(lo[2], _mm256_and_si256(_mm256_slli_epi16(q, 2), b4));
      lo[3] = _mm256_or_si256(lo[3], _mm256_and_si256(_mm256_slli_epi16(q, 1), b4));
      hi[0] = _mm256_or_si256(hi[0], _mm256_and_si256(q, b4));
      hi[1] = _mm256_or_si256(hi[1], _mm256_and_si256(_mm256_srli_epi16(q, 1), b4));
      hi[2] = _mm256_or_si256(hi[2], _mm256_and_si256(_mm256_srli_epi16(q, 2), b4));
      hi[3] = _mm256_or_si256(hi[3], _mm256_and_si256(_mm256_srli_epi16(q, 3), b4));
    }
    if constexpr (bits == 6) {
      const __m256i b45 = _mm256_set1_epi8(0x30);
      __m256i* halves[2] = {lo, hi};
      for (int half = 0; half < 2; ++half) {
        const __m256i q = load256(w + 256 + 64 * half + o);
        __m256i* v = halves[half];
        v[0] = _mm256_or_si256(v[0], _mm256_and_si256(_mm256_slli_epi16(q, 4), b45));
        v[1] = _mm256_or_si256(v[1], _mm256_and_si256(_mm256_slli_epi16(q, 2), b45));
        v[2] = _mm256_or_si256(v[2], _mm256_and_si256(q, b45));
        v[3] = _mm256_or_si256(v[3], _mm256_and_si256(_mm256_srli_epi16(q, 2), b45));
      }
    }
  }
}

SPECAIR_AVX2 inline __m256 half8(const uint8_t* q) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
}
SPECAIR_AVX2 inline __m256 u8x8(const uint8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}
SPECAIR_AVX2 inline __m256 i8x8(const uint8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}

// As scales512, for columns 8h..8h+7.
template <int F>
SPECAIR_AVX2 inline void scales256(const uint8_t* w, int h, __m256 sd, __m256 sm, __m256& ws0, __m256& ws1,
                                   __m256& wm) {
  const uint8_t* p = w + code_bytes(Fmt<F>::bits);
  if constexpr (Fmt<F>::scale == kPerBlock) {
    ws0 = ws1 = half8(p + 16 * h);
  } else if constexpr (Fmt<F>::scale == kPerBlockMin) {
    ws0 = ws1 = half8(p + 16 * h);
    wm = half8(p + 32 + 16 * h);
  } else if constexpr (Fmt<F>::scale == kSuperMin) {
    ws0 = ws1 = _mm256_mul_ps(sd, u8x8(p + 8 * h));
    wm = _mm256_mul_ps(sm, u8x8(p + 16 + 8 * h));
  } else {
    ws0 = _mm256_mul_ps(sd, i8x8(p + 8 * h));
    ws1 = _mm256_mul_ps(sd, i8x8(p + 16 + 8 * h));
  }
}

// The exact integer dot products of one block's low and high halves for 8 columns. Without VNNI, maddubs' int16
// pair sums are added in int16 only as far as nothing can saturate: 4-bit codes (pairs <= 3810) over the whole
// block (<= 30480, widened once, low and high halves together: `joint`), 5-bit codes (<= 7874) over a half
// (<= 31496), 6-bit codes (<= 16002) two at a time (<= 32004). Q8_0's signed codes are multiplied with their
// signs moved onto the activations (|code| <= 128, pairs <= 32512), each pair sum widened.
template <int F, bool kVnni>
SPECAIR_AVX2 inline void block_dot(const __m256i* lo, const __m256i* hi, const int32_t* xq, __m256i& s0, __m256i& s1,
                                   bool joint) {
  constexpr int bits = Fmt<F>::bits;
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (kVnni) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      const __m256i a = kSigned<F> ? _mm256_xor_si256(lo[g], flip) : lo[g];
      const __m256i c = kSigned<F> ? _mm256_xor_si256(hi[g], flip) : hi[g];
      s0 = _mm256_dpbusd_avx_epi32(s0, a, _mm256_set1_epi32(xq[g]));
      s1 = _mm256_dpbusd_avx_epi32(s1, c, _mm256_set1_epi32(xq[4 + g]));
    }
  } else if constexpr (kSigned<F>) {
    s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      const __m256i a = _mm256_set1_epi32(xq[g]), c = _mm256_set1_epi32(xq[4 + g]);
      s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(lo[g]), _mm256_sign_epi8(a, lo[g])), ones));
      s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(hi[g]), _mm256_sign_epi8(c, hi[g])), ones));
    }
  } else {
    __m256i p[2][4];
    for (int g = 0; g < 4; ++g) {
      p[0][g] = _mm256_maddubs_epi16(lo[g], _mm256_set1_epi32(xq[g]));
      p[1][g] = _mm256_maddubs_epi16(hi[g], _mm256_set1_epi32(xq[4 + g]));
    }
    if constexpr (bits == 4) {
      const __m256i a = _mm256_add_epi16(_mm256_add_epi16(p[0][0], p[0][1]), _mm256_add_epi16(p[0][2], p[0][3]));
      const __m256i c = _mm256_add_epi16(_mm256_add_epi16(p[1][0], p[1][1]), _mm256_add_epi16(p[1][2], p[1][3]));
      if (joint) {
        s0 = _mm256_madd_epi16(_mm256_add_epi16(a, c), ones);
        s1 = _mm256_setzero_si256();
      } else {
        s0 = _mm256_madd_epi16(a, ones);
        s1 = _mm256_madd_epi16(c, ones);
      }
    } else if constexpr (bits == 5) {
      s0 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0][0], p[0][1]), _mm256_add_epi16(p[0][2], p[0][3])), ones);
      s1 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[1][0], p[1][1]), _mm256_add_epi16(p[1][2], p[1][3])), ones);
    } else {
      s0 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0][0], p[0][1]), ones),
                            _mm256_madd_epi16(_mm256_add_epi16(p[0][2], p[0][3]), ones));
      s1 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[1][0], p[1][1]), ones),
                            _mm256_madd_epi16(_mm256_add_epi16(p[1][2], p[1][3]), ones));
    }
  }
}

template <int F, bool kVnni>
SPECAIR_AVX2 void tiles_avx2(const Q8Rows& x, int64_t M, int64_t K, int64_t N, const uint8_t* rec,
                             const uint8_t* sup, float* y, int64_t t0, int64_t t1) {
  using T = Fmt<F>;
  constexpr int R = kRecord<F>, S = kSuperBytes<F>;
  constexpr int offset = kSigned<F> ? (kVnni ? 128 : 0) : T::offset;
  constexpr bool halves = T::scale == kSuperHalves;
  const int64_t nb = K / kBlock, nsb = nb / kSuper;
  for (int64_t t = t0; t < t1; ++t) {
    for (int h = 0; h < 2; ++h) {  // columns 8h .. 8h+7 of the tile
      const int64_t n0 = t * kTile + 8 * h;
      if (n0 >= N) break;
      for (int64_t r0 = 0; r0 < M; r0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, M - r0));
        __m256 acc[kRows], sd = _mm256_setzero_ps(), sm = _mm256_setzero_ps();
        for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t tb = t * nb + b;
          const uint8_t* w = rec + tb * R;
          if (S && b % kSuper == 0) {
            const uint8_t* s = sup + (t * nsb + b / kSuper) * S;
            sd = half8(s + 16 * h);
            if constexpr (T::scale == kSuperMin) sm = half8(s + 32 + 16 * h);
          }
          __m256i lo[4], hi[4];
          codes256<F>(w, h, lo, hi);
          __m256 ws0, ws1, wm = _mm256_setzero_ps();
          scales256<F>(w, h, sd, sm, ws0, ws1, wm);
          for (int r = 0; r < kRows; ++r) {
            if (r >= rows) break;
            const int32_t* xq = reinterpret_cast<const int32_t*>(x.q + (r0 + r) * K + b * kBlock);
            __m256i s0, s1;
            block_dot<F, kVnni>(lo, hi, xq, s0, s1, !halves);
            const int64_t rb = (r0 + r) * nb + b;
            if constexpr (offset != 0) {
              s0 = _mm256_sub_epi32(s0, _mm256_set1_epi32(offset * x.isum[2 * rb]));
              s1 = _mm256_sub_epi32(s1, _mm256_set1_epi32(offset * x.isum[2 * rb + 1]));
            }
            const __m256 dx = _mm256_set1_ps(x.scale[rb]);
            if constexpr (halves) {
              acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(ws0, dx), acc[r]);
              acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(ws1, dx), acc[r]);
            } else {
              acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), _mm256_mul_ps(ws0, dx), acc[r]);
            }
            if constexpr (T::scale == kPerBlockMin)
              acc[r] = _mm256_fmadd_ps(wm, _mm256_set1_ps(x.sum[rb]), acc[r]);
            if constexpr (T::scale == kSuperMin)
              acc[r] = _mm256_fnmadd_ps(wm, _mm256_set1_ps(x.sum[rb]), acc[r]);
          }
        }
        for (int r = 0; r < rows; ++r) {
          if (N - n0 >= 8) {
            _mm256_storeu_ps(y + (r0 + r) * N + n0, acc[r]);
          } else {
            alignas(32) float tmp[8];
            _mm256_store_ps(tmp, acc[r]);
            std::memcpy(y + (r0 + r) * N + n0, tmp, sizeof(float) * (N - n0));
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------ floats

template <int F>
inline float float_at(const uint8_t* rec, int64_t i) {
  if constexpr (F == kF16) {
    return half_to_float(load_half(rec, static_cast<int>(i)));
  } else {
    float v;
    std::memcpy(&v, rec + 4 * i, sizeof v);
    return v;
  }
}

template <int F>
void float_portable(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* rec, float* y, int64_t t0,
                    int64_t t1) {
  constexpr int64_t R = F == kF16 ? 2 * kBlock * kTile : 4 * kBlock * kTile;
  for (int64_t t = t0; t < t1; ++t)
    for (int c = 0; c < kTile && t * kTile + c < N; ++c)
      for (int64_t r = 0; r < M; ++r) {
        float acc = 0.0f;
        for (int64_t k = 0; k < K; ++k)
          acc = std::fma(x[r * K + k], float_at<F>(rec + (t * (K / kBlock) + k / kBlock) * R, (k % kBlock) * kTile + c),
                         acc);
        y[r * N + t * kTile + c] = acc;
      }
}

template <int F>
SPECAIR_AVX512 void float_avx512(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* rec, float* y,
                                 int64_t t0, int64_t t1) {
  constexpr int64_t size = F == kF16 ? 2 : 4;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * kTile;
    const __mmask16 keep = N - n0 >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << (N - n0)) - 1);
    const uint8_t* w = rec + t * K * kTile * size;
    for (int64_t r0 = 0; r0 < M; r0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - r0));
      __m512 acc[kRows];
      for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        const uint8_t* p = w + k * kTile * size;
        if (r0 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + 16 * kTile * size), _MM_HINT_T0);
        const __m512 v = F == kF16 ? half16(p) : _mm512_loadu_ps(reinterpret_cast<const float*>(p));
        for (int r = 0; r < kRows; ++r) {
          if (r >= rows) break;
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[(r0 + r) * K + k]), v, acc[r]);
        }
      }
      for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * N + n0, keep, acc[r]);
    }
  }
}

template <int F>
SPECAIR_AVX2 void float_avx2(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* rec, float* y,
                             int64_t t0, int64_t t1) {
  constexpr int64_t size = F == kF16 ? 2 : 4;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* w = rec + t * K * kTile * size;
    for (int h = 0; h < 2; ++h) {
      const int64_t n0 = t * kTile + 8 * h;
      if (n0 >= N) break;
      for (int64_t r0 = 0; r0 < M; r0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, M - r0));
        __m256 acc[kRows];
        for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; ++k) {
          const uint8_t* p = w + (k * kTile + 8 * h) * size;
          const __m256 v = F == kF16 ? half8(p) : _mm256_loadu_ps(reinterpret_cast<const float*>(p));
          for (int r = 0; r < kRows; ++r) {
            if (r >= rows) break;
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[(r0 + r) * K + k]), v, acc[r]);
          }
        }
        for (int r = 0; r < rows; ++r) {
          alignas(32) float tmp[8];
          _mm256_store_ps(tmp, acc[r]);
          std::memcpy(y + (r0 + r) * N + n0, tmp, sizeof(float) * std::min<int64_t>(8, N - n0));
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------ dispatch

using TilesFn = void (*)(const Q8Rows&, int64_t, int64_t, int64_t, const uint8_t*, const uint8_t*, float*, int64_t,
                         int64_t);
using FloatFn = void (*)(const float*, int64_t, int64_t, int64_t, const uint8_t*, float*, int64_t, int64_t);
using QuantizeFn = void (*)(const float*, int64_t, int64_t, int8_t*, float*, float*, int32_t*);

struct Dispatch {
  const char* isa;
  QuantizeFn quantize;
  TilesFn tiles[kF16];
  FloatFn floats[2];  // F16, F32
};

template <template <int> class Path, template <int> class Floats>
Dispatch table(const char* isa, QuantizeFn quantize) {
  return {isa, quantize,
          {Path<kQ4_0>::fn, Path<kQ4_1>::fn, Path<kQ5_0>::fn, Path<kQ5_1>::fn, Path<kQ8_0>::fn, Path<kQ4_K>::fn,
           Path<kQ5_K>::fn, Path<kQ6_K>::fn},
          {Floats<kF16>::fn, Floats<kF32>::fn}};
}

template <int F> struct Avx512Path { static constexpr TilesFn fn = tiles_avx512<F>; };
template <int F> struct AvxVnniPath { static constexpr TilesFn fn = tiles_avx2<F, true>; };
template <int F> struct Avx2Path { static constexpr TilesFn fn = tiles_avx2<F, false>; };
template <int F> struct PortablePath { static constexpr TilesFn fn = tiles_portable<F>; };
template <int F> struct Avx512Floats { static constexpr FloatFn fn = float_avx512<F>; };
template <int F> struct Avx2Floats { static constexpr FloatFn fn = float_avx2<F>; };
template <int F> struct PortableFloats { static constexpr FloatFn fn = float_portable<F>; };

Dispatch pick() {
  // SPECAIR_ISA=portable|avx2|avxvnni|avx512vnni caps the choice (tests compare the paths on one machine).
  const char* cap = std::getenv("SPECAIR_ISA");
  const auto allowed = [cap](const char* isa) { return cap == nullptr || std::strcmp(cap, isa) == 0; };
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                      __builtin_cpu_supports("avx512dq");
  if (avx512 && allowed("avx512vnni")) return table<Avx512Path, Avx512Floats>("avx512vnni", quantize_avx512);
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avxvnni") && allowed("avxvnni"))
    return table<AvxVnniPath, Avx2Floats>("avxvnni", quantize_portable);
  if (avx2 && allowed("avx2")) return table<Avx2Path, Avx2Floats>("avx2", quantize_portable);
  return table<PortablePath, PortableFloats>("portable", quantize_portable);
}

const Dispatch& dispatch() {
  static const Dispatch d = pick();
  return d;
}

// Weights of column c of block record w (super-block parameters s) into row[0..31].
template <int F>
inline void dequantize_block(const uint8_t* w, const uint8_t* s, int c, float* row) {
  float ws[2], wm;
  column_scales<F>(w, s, c, ws, &wm);
  for (int k = 0; k < kBlock; ++k) {
    const float v = ws[k >> 4] * static_cast<float>(code_at<F>(w, c, k) - Fmt<F>::offset);
    row[k] = Fmt<F>::scale == kPerBlockMin || Fmt<F>::scale == kSuperMin ? v + wm : v;
  }
}

template <int F>
void dequantize_format(int64_t K, int64_t N, const uint8_t* rec, const uint8_t* sup, float* out) {
  const int64_t nb = K / kBlock, nsb = nb / kSuper, tiles = (N + kTile - 1) / kTile;
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* w = rec + (t * nb + b) * kRecord<F>;
      const uint8_t* s = kSuperBytes<F> ? sup + (t * nsb + b / kSuper) * kSuperBytes<F> : nullptr;
      for (int c = 0; c < kTile && t * kTile + c < N; ++c) dequantize_block<F>(w, s, c, out + (t * kTile + c) * K + b * kBlock);
    }
}

template <int F>
void dequantize_row(int64_t K, const uint8_t* rec, const uint8_t* sup, int64_t n, float* out) {
  const int64_t nb = K / kBlock, nsb = nb / kSuper, t = n / kTile;
  for (int64_t b = 0; b < nb; ++b)
    dequantize_block<F>(rec + (t * nb + b) * kRecord<F>,
                        kSuperBytes<F> ? sup + (t * nsb + b / kSuper) * kSuperBytes<F> : nullptr,
                        static_cast<int>(n % kTile), out + b * kBlock);
}

}  // namespace

const FormatInfo& format_info(int format) { return kInfo[format]; }

int format_by_name(const char* name) {
  for (int f = 0; f < kFormatCount; ++f)
    if (std::strcmp(kInfo[f].name, name) == 0) return f;
  return -1;
}

const char* blocks_isa() { return dispatch().isa; }

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q8, float* scale, float* sum, int32_t* isum) {
  dispatch().quantize(x, M, K, q8, scale, sum, isum);
}

bool is_float(int format) { return format == kF16 || format == kF32; }

void blocks_tiles(int format, const Q8Rows& x, const float* xf, int64_t M, int64_t K, int64_t N,
                  const uint8_t* records, const uint8_t* super, float* y, int64_t tile_begin, int64_t tile_end) {
  if (is_float(format))
    dispatch().floats[format - kF16](xf, M, K, N, records, y, tile_begin, tile_end);
  else
    dispatch().tiles[format](x, M, K, N, records, super, y, tile_begin, tile_end);
}

void blocks_dequantize(int format, int64_t K, int64_t N, const uint8_t* records, const uint8_t* super, float* w) {
  using Fn = void (*)(int64_t, int64_t, const uint8_t*, const uint8_t*, float*);
  static const Fn fns[kF16] = {dequantize_format<kQ4_0>, dequantize_format<kQ4_1>, dequantize_format<kQ5_0>,
                               dequantize_format<kQ5_1>, dequantize_format<kQ8_0>, dequantize_format<kQ4_K>,
                               dequantize_format<kQ5_K>, dequantize_format<kQ6_K>};
  if (is_float(format)) {
    for (int64_t n = 0; n < N; ++n) blocks_row(format, K, records, super, n, w + n * K);
    return;
  }
  fns[format](K, N, records, super, w);
}

void blocks_row(int format, int64_t K, const uint8_t* records, const uint8_t* super, int64_t n, float* w) {
  using Fn = void (*)(int64_t, const uint8_t*, const uint8_t*, int64_t, float*);
  static const Fn fns[kF16] = {dequantize_row<kQ4_0>, dequantize_row<kQ4_1>, dequantize_row<kQ5_0>,
                               dequantize_row<kQ5_1>, dequantize_row<kQ8_0>, dequantize_row<kQ4_K>,
                               dequantize_row<kQ5_K>, dequantize_row<kQ6_K>};
  if (is_float(format)) {
    const int64_t R = kInfo[format].record;
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t* rec = records + ((n / kTile) * (K / kBlock) + k / kBlock) * R;
      const int64_t i = (k % kBlock) * kTile + n % kTile;
      w[k] = format == kF16 ? float_at<kF16>(rec, i) : float_at<kF32>(rec, i);
    }
    return;
  }
  fns[format](K, records, super, n, w);
}

}  // namespace specair
