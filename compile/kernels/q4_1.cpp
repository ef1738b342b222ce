// Q4_1 x Q8 linear kernels: AVX-512 VNNI, AVX2 (AVX-VNNI where present) and portable, picked once by CPU.
// See q4_1.h for the layout and why every path is row-independent.
#include "q4_1.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace specair {
namespace {

constexpr int kRows = 4;  // rows per register chunk: 2 int + 1 float accumulator each, plus 8 unpacked weights

// Weights stream from memory once per pass: fetching a few blocks ahead keeps a core's loads in flight across
// the short matrices of a decode step, where the hardware prefetcher has little time to ramp up.
constexpr int kAhead = 12;

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

// Block tb + kAhead of a tile's packed codes, scales and minima (tb = tile * K/32 + block).
inline void prefetch_ahead(const uint8_t* packed, const uint16_t* scales, const uint16_t* mins, int64_t tb) {
  const int64_t next = tb + kAhead;
  for (int g = 0; g < 4; ++g) _mm_prefetch(reinterpret_cast<const char*>(packed + next * 256 + 64 * g), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scales + next * kTile), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(mins + next * kTile), _MM_HINT_T0);
}

inline float block_scale(float amax) { return amax / 127.0f; }
inline float block_inverse(float amax) { return amax > 0.0f ? 127.0f / amax : 0.0f; }

void quantize_portable(const float* x, int64_t M, int64_t K, int8_t* q8, float* scale, float* sum) {
  const int64_t nb = K / kBlock;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + r * K + b * kBlock;
      float amax = 0.0f, s = 0.0f;
      for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
      for (int i = 0; i < kBlock; ++i) s += v[i];
      const float inv = block_inverse(amax);
      for (int i = 0; i < kBlock; ++i)
        q8[r * K + b * kBlock + i] = static_cast<int8_t>(std::clamp(std::nearbyint(v[i] * inv), -127.0f, 127.0f));
      scale[r * nb + b] = block_scale(amax);
      sum[r * nb + b] = s;
    }
  }
}

void tiles_portable(const Q8Rows& x, int64_t M, int64_t K, int64_t N, const uint8_t* packed, const uint16_t* scales,
                    const uint16_t* mins, float* y, int64_t t0, int64_t t1) {
  const int64_t nb = K / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
    for (int c = 0; c < kTile; ++c) {
      const int64_t n = t * kTile + c;
      if (n >= N) break;
      for (int64_t r = 0; r < M; ++r) {
        const int8_t* xq = x.q + r * K;
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* w = packed + (t * nb + b) * 256;
          int32_t dot = 0;
          for (int g = 0; g < 4; ++g)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = w[64 * g + 4 * c + i];
              dot += (byte & 15) * xq[b * kBlock + 4 * g + i] + (byte >> 4) * xq[b * kBlock + 16 + 4 * g + i];
            }
          const float d = half_to_float(scales[(t * nb + b) * kTile + c]);
          const float m = half_to_float(mins[(t * nb + b) * kTile + c]);
          acc = std::fma(static_cast<float>(dot), d * x.scale[r * nb + b], acc);
          acc = std::fma(m, x.sum[r * nb + b], acc);
        }
        y[r * N + n] = acc;
      }
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void quantize_avx512(const float* x, int64_t M, int64_t K, int8_t* q8, float* scale, float* sum) {
  const int64_t nb = K / kBlock;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + r * K + b * kBlock;
      const __m512 a = _mm512_loadu_ps(v), c = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
      const __m512 inv = _mm512_set1_ps(block_inverse(amax));
      // cvtps rounds to nearest even, as nearbyint does in the portable path.
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + r * K + b * kBlock), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + r * K + b * kBlock + 16), _mm512_cvtsepi32_epi8(qc));
      scale[r * nb + b] = block_scale(amax);
      sum[r * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void tiles_avx512(const Q8Rows& x, int64_t M, int64_t K, int64_t N, const uint8_t* packed, const uint16_t* scales,
                  const uint16_t* mins, float* y, int64_t t0, int64_t t1) {
  const int64_t nb = K / kBlock;
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * kTile;
    const __mmask16 keep = N - n0 >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << (N - n0)) - 1);
    for (int64_t r0 = 0; r0 < M; r0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - r0));
      __m512 acc[kRows];
      for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t tb = t * nb + b;
        const uint8_t* w = packed + tb * 256;
        if (r0 == 0) prefetch_ahead(packed, scales, mins, tb);
        __m512i lo[4], hi[4];
        for (int g = 0; g < 4; ++g) {
          const __m512i v = _mm512_loadu_si512(w + 64 * g);
          lo[g] = _mm512_and_si512(v, low);
          hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + tb * kTile)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + tb * kTile)));
        for (int r = 0; r < kRows; ++r) {
          if (r >= rows) break;
          const int32_t* xq = reinterpret_cast<const int32_t*>(x.q + (r0 + r) * K + b * kBlock);
          __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
          for (int g = 0; g < 4; ++g) {
            s0 = _mm512_dpbusd_epi32(s0, lo[g], _mm512_set1_epi32(xq[g]));
            s1 = _mm512_dpbusd_epi32(s1, hi[g], _mm512_set1_epi32(xq[4 + g]));
          }
          const int64_t rb = (r0 + r) * nb + b;
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                                   _mm512_mul_ps(d, _mm512_set1_ps(x.scale[rb])), acc[r]);
          acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sum[rb]), acc[r]);
        }
      }
      for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * N + n0, keep, acc[r]);
    }
  }
}

// One block's exact integer dot products for 8 columns: codes lo/hi (u8 <= 15) against a row's 32 int8
// activations (|x| <= 127). Without VNNI, maddubs' pair sums (|.| <= 3810) add up in int16 over the whole
// block (|.| <= 30480, so nothing saturates or wraps) and widen to int32 once.
template <bool kVnni>
__attribute__((target("avx2,fma,avxvnni")))
inline __m256i block_dot(const __m256i* lo, const __m256i* hi, const int32_t* xq) {
  if constexpr (kVnni) {
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      s0 = _mm256_dpbusd_avx_epi32(s0, lo[g], _mm256_set1_epi32(xq[g]));
      s1 = _mm256_dpbusd_avx_epi32(s1, hi[g], _mm256_set1_epi32(xq[4 + g]));
    }
    return _mm256_add_epi32(s0, s1);
  } else {
    __m256i p0 = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(xq[0]));
    __m256i p1 = _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(xq[4]));
    for (int g = 1; g < 4; ++g) {
      p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(lo[g], _mm256_set1_epi32(xq[g])));
      p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(hi[g], _mm256_set1_epi32(xq[4 + g])));
    }
    return _mm256_madd_epi16(_mm256_add_epi16(p0, p1), _mm256_set1_epi16(1));
  }
}

template <bool kVnni>
__attribute__((target("avx2,fma,f16c,avxvnni")))
void tiles_avx2(const Q8Rows& x, int64_t M, int64_t K, int64_t N, const uint8_t* packed, const uint16_t* scales,
                const uint16_t* mins, float* y, int64_t t0, int64_t t1) {
  const int64_t nb = K / kBlock;
  const __m256i low = _mm256_set1_epi8(15);
  for (int64_t t = t0; t < t1; ++t) {
    for (int h = 0; h < 2; ++h) {  // columns 8h .. 8h+7 of the tile
      const int64_t n0 = t * kTile + 8 * h;
      if (n0 >= N) break;
      for (int64_t r0 = 0; r0 < M; r0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, M - r0));
        __m256 acc[kRows];
        for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t tb = t * nb + b;
          const uint8_t* w = packed + tb * 256 + 32 * h;
          if (r0 == 0 && h == 0) prefetch_ahead(packed, scales, mins, tb);
          __m256i lo[4], hi[4];
          for (int g = 0; g < 4; ++g) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * g));
            lo[g] = _mm256_and_si256(v, low);
            hi[g] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          }
          const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + tb * kTile + 8 * h)));
          const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + tb * kTile + 8 * h)));
          for (int r = 0; r < kRows; ++r) {
            if (r >= rows) break;
            const int32_t* xq = reinterpret_cast<const int32_t*>(x.q + (r0 + r) * K + b * kBlock);
            const __m256i dot = block_dot<kVnni>(lo, hi, xq);
            const int64_t rb = (r0 + r) * nb + b;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                     _mm256_mul_ps(d, _mm256_set1_ps(x.scale[rb])), acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.sum[rb]), acc[r]);
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

using TilesFn = void (*)(const Q8Rows&, int64_t, int64_t, int64_t, const uint8_t*, const uint16_t*,
                         const uint16_t*, float*, int64_t, int64_t);
using QuantizeFn = void (*)(const float*, int64_t, int64_t, int8_t*, float*, float*);

struct Dispatch {
  const char* isa;
  TilesFn tiles;
  QuantizeFn quantize;
};

Dispatch pick() {
  // SPECAIR_Q4_ISA=portable|avx2|avx512vnni caps the choice (tests compare the paths on one machine).
  const char* cap = std::getenv("SPECAIR_Q4_ISA");
  const auto allowed = [cap](const char* isa) { return cap == nullptr || std::strcmp(cap, isa) == 0; };
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  if (avx512 && (cap == nullptr || std::strcmp(cap, "avx512vnni") == 0))
    return {"avx512vnni", tiles_avx512, quantize_avx512};
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avxvnni") && allowed("avxvnni"))
    return {"avxvnni", tiles_avx2<true>, quantize_portable};
  if (avx2 && allowed("avx2")) return {"avx2", tiles_avx2<false>, quantize_portable};
  return {"portable", tiles_portable, quantize_portable};
}

const Dispatch& dispatch() {
  static const Dispatch d = pick();
  return d;
}

}  // namespace

const char* q4_1_isa() { return dispatch().isa; }

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q8, float* scale, float* sum) {
  dispatch().quantize(x, M, K, q8, scale, sum);
}

void q4_1_tiles(const Q8Rows& x, int64_t M, int64_t K, int64_t N, const uint8_t* packed, const uint16_t* scales,
                const uint16_t* mins, float* y, int64_t tile_begin, int64_t tile_end) {
  dispatch().tiles(x, M, K, N, packed, scales, mins, y, tile_begin, tile_end);
}

}  // namespace specair
