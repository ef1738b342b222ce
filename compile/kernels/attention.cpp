// See attention.h. One work item is one (row, head, token) query; its keys are the committed slots, then the
// step's own tokens, in slot order. The SIMD paths (attention_simd.inc) take the dot product over D in vector
// lanes with a fixed reduction, exp by one polynomial for all lanes, and the value sum over the visible keys
// in order; the portable path does the same element by element, with the C library's exp.
#include "attention.h"
#include "exp.h"
#include "lanes.h"

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
using namespace lanes512;
#include "attention_simd.inc"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
using namespace lanes256;
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
