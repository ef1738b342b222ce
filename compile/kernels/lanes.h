// Vector lanes for the kernels that run float math in SIMD registers (attention, SwiGLU): per instruction set,
// a namespace with V (the vector), kW (its lanes), the lane helpers, and exp of non-positive lanes. Each
// namespace's functions are compiled for its instruction set only; callers pick one by the CPU at run time.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "exp.h"

namespace specair {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,fma")
namespace lanes512 {
using V = __m512;
constexpr int kW = 16;
inline __mmask16 part(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
inline V zero() { return _mm512_setzero_ps(); }
inline V set1(float x) { return _mm512_set1_ps(x); }
inline V load(const float* p) { return _mm512_loadu_ps(p); }
inline V load_part(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(part(n), p); }
inline void store(float* p, V x) { _mm512_storeu_ps(p, x); }
inline void store_part(float* p, V x, int64_t n) { _mm512_mask_storeu_ps(p, part(n), x); }
inline V keep_part(V x, int64_t n) { return _mm512_maskz_mov_ps(part(n), x); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float reduce_add(V x) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline V max(V a, V b) { return _mm512_max_ps(a, b); }
inline V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
inline V round_nearest(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V times_pow2(V p, V n) { return _mm512_scalef_ps(p, n); }

#include "lanes_exp.inc"
}  // namespace lanes512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace lanes256 {
using V = __m256;
constexpr int kW = 8;
inline __m256i part(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline V zero() { return _mm256_setzero_ps(); }
inline V set1(float x) { return _mm256_set1_ps(x); }
inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline V load_part(const float* p, int64_t n) { return _mm256_maskload_ps(p, part(n)); }
inline void store(float* p, V x) { _mm256_storeu_ps(p, x); }
inline void store_part(float* p, V x, int64_t n) { _mm256_maskstore_ps(p, part(n), x); }
inline V keep_part(V x, int64_t n) { return _mm256_and_ps(x, _mm256_castsi256_ps(part(n))); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float reduce_add(V x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline V max(V a, V b) { return _mm256_max_ps(a, b); }
inline V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
inline V round_nearest(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V times_pow2(V p, V n) {  // n >= -126 where exp uses it, so 2^n is a normal float
  return mul(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                                        _mm256_set1_epi32(127)), 23)));
}

#include "lanes_exp.inc"
}  // namespace lanes256
#pragma GCC pop_options

}  // namespace specair
