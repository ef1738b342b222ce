#include "rowwise.h"

#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "exp.h"

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
__attribute__((target("avx512f,avx512dq"))) void swiglu_avx512(const float* gate_up, int64_t F, float* out) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  int64_t f = 0;
  for (; f + 16 <= F; f += 16) {
    const __m512 g = _mm512_loadu_ps(gate_up + f), up = _mm512_loadu_ps(gate_up + F + f);
    const __m512 x = _mm512_max_ps(_mm512_sub_ps(zero, _mm512_abs_ps(g)), _mm512_set1_ps(kExpMin));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x));
    __m512 p = _mm512_set1_ps(kP[0]);
    for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP[i]));
    const __m512 e = _mm512_scalef_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, one)), n);
    const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, zero, _CMP_GE_OQ), e, one);
    _mm512_storeu_ps(out + f, _mm512_mul_ps(_mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, e))), up));
  }
  for (; f < F; ++f) out[f] = swiglu_one(gate_up[f], gate_up[F + f]);
}

using SwigluFn = void (*)(const float*, int64_t, float*);

SwigluFn pick_swiglu() {
  const char* cap = std::getenv("SPECAIR_ISA");  // capped as the block kernels are
  __builtin_cpu_init();
  if ((cap == nullptr || std::strcmp(cap, "avx512vnni") == 0) && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512dq"))
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
