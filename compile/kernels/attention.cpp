// See attention.h. One work item is one (row, head, token) query; its keys are the committed slots, then the
// step's own tokens, in slot order. The dot product over D uses 16 lanes and a fixed reduction; exp is the C
// library's, element by element; the value sum runs over the visible keys in order.
#include "attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace specair {
namespace {

constexpr float kHidden = -1e30f;

float dot_portable(const float* a, const float* b, int64_t D) {
  float lane[16] = {};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16)
    for (int i = 0; i < 16; ++i) lane[i] = std::fma(a[d + i], b[d + i], lane[i]);
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += lane[i];
  for (; d < D; ++d) s = std::fma(a[d], b[d], s);
  return s;
}

__attribute__((target("avx512f")))
float dot_avx512(const float* a, const float* b, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  float s = _mm512_reduce_add_ps(acc);
  for (; d < D; ++d) s = std::fma(a[d], b[d], s);
  return s;
}

using DotFn = float (*)(const float*, const float*, int64_t);

DotFn pick_dot() {
  __builtin_cpu_init();
  const char* cap = std::getenv("SPECAIR_Q4_ISA");
  const bool portable = cap != nullptr && std::strcmp(cap, "portable") == 0;
  return !portable && __builtin_cpu_supports("avx512f") ? dot_avx512 : dot_portable;
}

}  // namespace

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
  static const DotFn dot = pick_dot();
  const int64_t D = a.D, group = a.H / a.Hkv;
  thread_local std::vector<float> score, acc;
  thread_local std::vector<int64_t> slot;
  if (score.size() < static_cast<size_t>(a.S)) score.resize(a.S), slot.resize(a.S);
  if (acc.size() < static_cast<size_t>(D)) acc.resize(D);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t t = item % a.T, h = (item / a.T) % a.H, b = item / (a.T * a.H), kv = h / group;
    const int64_t len = a.seqlens[b] + 1 - a.T, last = len + t;  // causal: slots 0 .. last
    const float* q = a.q + (b * a.T + t) * a.H * D + h * D;
    const float* kc = a.k_present + (b * a.Hkv + kv) * a.S * D;
    const float* vc = a.v_present + (b * a.Hkv + kv) * a.S * D;
    const float* bias = a.bias ? a.bias + ((a.bias_batch == 1 ? 0 : b) * a.T + t) * a.S : nullptr;
    int64_t n = 0;
    float top = -INFINITY;
    for (int64_t j = 0; j <= last && j < a.S; ++j) {
      float s = dot(q, kc + j * D, D) * a.scale;
      if (bias) {
        if (bias[j] <= kHidden) continue;
        s += bias[j];
      }
      score[n] = s;
      slot[n++] = j;
      top = std::fmax(top, s);
    }
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += (score[i] = std::exp(score[i] - top));
    std::fill(acc.begin(), acc.begin() + D, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      const float* v = vc + slot[i] * D;
      const float p = score[i];
      for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(p, v[d], acc[d]);
    }
    float* o = a.out + (b * a.T + t) * a.H * D + h * D;
    const float inv = 1.0f / sum;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
  }
}

}  // namespace specair
