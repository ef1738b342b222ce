#include "rowwise.h"

#include <cmath>

namespace specair {

void rms_norm_row(const float* x, const float* w, float eps, int64_t K, float* out) {
  float s = 0.0f;
  for (int64_t k = 0; k < K; ++k) s += x[k] * x[k];
  const float r = 1.0f / std::sqrt(s / static_cast<float>(K) + eps);
  for (int64_t k = 0; k < K; ++k) out[k] = w[k] * (x[k] * r);
}

void swiglu_row(const float* gate_up, int64_t F, float* out) {
  for (int64_t f = 0; f < F; ++f) {
    const float g = gate_up[f];
    out[f] = g / (1.0f + std::exp(-g)) * gate_up[F + f];
  }
}

}  // namespace specair
