// See attention.h. One work item is one (row, head, token) query; its keys are the committed slots, then the
// step's own tokens, in slot order. The SIMD paths (attention_simd.inc) take the dot product over D in vector
// lanes with a fixed reduction, exp by one polynomial for all lanes, and the value sum over the visible keys
// in order; the portable path does the same element by element, with the C library's exp.
#include "attention.h"
#include "exp.h"

#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace specair {
namespace {

constexpr float kHidden = -1e30f;

// The SIMD paths' exp (exp.h) clamps below -87 to exp(-87), about 1.6e-38, whose weight vanishes beside the
// largest score's 1.

namespace portable {

void item(const AttentionArgs& a, const float* q, const float* kc, const float* vc, const float* bias,
          const int64_t* slot, int64_t n, float* score, float* o) {
  const int64_t D = a.D;
  float top = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const float* k = kc + slot[i] * D;
    float s = 0.0f;
    for (int64_t d = 0; d < D; ++d) s += q[d] * k[d];
    s *= a.scale;
    if (bias) s += bias[slot[i]];
    score[i] = s;
    top = std::fmax(top, s);
  }
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += (score[i] = std::exp(score[i] - top));
  for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float* v = vc + slot[i] * D;
    for (int64_t d = 0; d < D; ++d) o[d] += score[i] * v[d];
  }
  const float inv = 1.0f / sum;
  for (int64_t d = 0; d < D; ++d) o[d] *= inv;
}

}  // namespace portable

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,fma")
namespace avx512 {

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

#include "attention_simd.inc"

}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {

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

#include "attention_simd.inc"

}  // namespace avx2
#pragma GCC pop_options

using ItemFn = void (*)(const AttentionArgs&, const float*, const float*, const float*, const float*,
                        const int64_t*, int64_t, float*, float*);

struct Dispatch {
  const char* isa;
  ItemFn item;
};

Dispatch pick() {
  // SPECAIR_ISA caps this choice as it does the block kernels' (avx512vnni, avxvnni/avx2, portable).
  const char* cap = std::getenv("SPECAIR_ISA");
  const bool any = cap == nullptr || std::strcmp(cap, "avx512vnni") == 0;
  __builtin_cpu_init();
  if (any && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw"))
    return {"avx512", avx512::item};
  const bool avx2_ok = any || std::strcmp(cap, "avx2") == 0 || std::strcmp(cap, "avxvnni") == 0;
  if (avx2_ok && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return {"avx2", avx2::item};
  return {"portable", portable::item};
}

const Dispatch& dispatch() {
  static const Dispatch d = pick();
  return d;
}

}  // namespace

const char* attention_isa() { return dispatch().isa; }

void attention_write_kv(const AttentionArgs& a) {
  const int64_t cache = a.Hkv * a.S * a.D;
  for (int64_t b = 0; b < a.B; ++b) {
    const int64_t len = a.seqlens[b] + 1 - a.T;
    const float* pasts[2] = {a.k_cache, a.v_cache};
    const float* steps[2] = {a.k, a.v};
    float* presents[2] = {a.k_present, a.v_present};
    for (int c = 0; c < 2; ++c) {
      if (presents[c] != pasts[c])
        std::memcpy(presents[c] + b * cache, pasts[c] + b * cache, sizeof(float) * cache);
      for (int64_t t = 0; t < a.T; ++t)
        for (int64_t h = 0; h < a.Hkv; ++h)
          std::memcpy(presents[c] + b * cache + (h * a.S + len + t) * a.D,
                      steps[c] + ((b * a.T + t) * a.Hkv + h) * a.D, sizeof(float) * a.D);
    }
  }
}

void attention_rows(const AttentionArgs& a, int64_t begin, int64_t end) {
  const ItemFn item = dispatch().item;
  const int64_t D = a.D, group = a.H / a.Hkv;
  thread_local std::vector<float> score;
  thread_local std::vector<int64_t> slot;
  if (score.size() < static_cast<size_t>(a.S)) score.resize(a.S), slot.resize(a.S);
  for (int64_t w = begin; w < end; ++w) {
    const int64_t t = w % a.T, h = (w / a.T) % a.H, b = w / (a.T * a.H), kv = h / group;
    const int64_t last = a.seqlens[b] + 1 - a.T + t;  // causal: slots 0 .. last
    const float* bias = a.bias ? a.bias + ((a.bias_batch == 1 ? 0 : b) * a.T + t) * a.S : nullptr;
    int64_t n = 0;
    for (int64_t j = 0; j <= last && j < a.S; ++j)
      if (!bias || bias[j] > kHidden) slot[n++] = j;
    item(a, a.q + (b * a.T + t) * a.H * D + h * D, a.k_present + (b * a.Hkv + kv) * a.S * D,
         a.v_present + (b * a.Hkv + kv) * a.S * D, bias, slot.data(), n, score.data(),
         a.out + (b * a.T + t) * a.H * D + h * D);
  }
}

}  // namespace specair
