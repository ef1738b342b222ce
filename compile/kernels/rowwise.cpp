#include "rowwise.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "exp.h"
#include "lanes.h"

namespace specair {
namespace {

// silu(g) * up with exp taken of -|g| only (exp.h's range), so no lane overflows: sigmoid(g) is 1 / (1 + e)
// for g >= 0 and e / (1 + e) below, e = exp(-|g|).
inline float swiglu_one(float g, float up) {
  const float e = exp_nonpositive(std::fmax(-std::fabs(g), kExpMin));
  return g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e)) * up;
}

void swiglu_portable(const float* gate_up, int64_t F, float* out) {
  for (int64_t f = 0; f < F; ++f) out[f] = swiglu_one(gate_up[f], gate_up[F + f]);
}

// The decode step's largest elementwise operator (the MLP's F = 3-4x hidden); one lane per element.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,fma")
void swiglu_avx512(const float* gate_up, int64_t F, float* out) {
  using namespace lanes512;
  const V one = set1(1.0f);
  int64_t f = 0;
  for (; f + kW <= F; f += kW) {
    const V g = load(gate_up + f), e = exp_nonpositive(sub(zero(), _mm512_abs_ps(g)));
    const V num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, zero(), _CMP_GE_OQ), e, one);
    store(out + f, mul(mul(g, _mm512_div_ps(num, add(one, e))), load(gate_up + F + f)));
  }
  for (; f < F; ++f) out[f] = swiglu_one(gate_up[f], gate_up[F + f]);
}
#pragma GCC pop_options

using SwigluFn = void (*)(const float*, int64_t, float*);

SwigluFn pick_swiglu() {
  const char* cap = std::getenv("SPECAIR_ISA");  // capped as the block kernels are
  __builtin_cpu_init();
  if ((cap == nullptr || std::strcmp(cap, "avx512vnni") == 0) && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw"))
    return swiglu_avx512;
  return swiglu_portable;
}

}  // namespace

void rms_norm_row(const float* x, const float* w, float eps, int64_t K, float* out) {
  float s = 0.0f;
  for (int64_t k = 0; k < K; ++k) s += x[k] * x[k];
  const float r = 1.0f / std::sqrt(s / static_cast<float>(K) + eps);
  for (int64_t k = 0; k < K; ++k) out[k] = w[k] * (x[k] * r);
}

void swiglu_row(const float* gate_up, int64_t F, float* out) {
  static const SwigluFn fn = pick_swiglu();
  fn(gate_up, F, out);
}

}  // namespace specair
