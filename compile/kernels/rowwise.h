// Row-wise steps around the block products, each row computed alone in a fixed order (row-independent):
// RMSNorm, x * (1 / sqrt(mean(x^2) + eps)) * w, and SwiGLU, silu(gate) * up of a fused gate/up row.
// MatMulBlocks runs them as its prologue where onnx_fusion folds them in; these ops run them where it does not.
#pragma once
#include <cstdint>

namespace specair {

// x [K] -> out [K].
void rms_norm_row(const float* x, const float* w, float eps, int64_t K, float* out);

// gate_up [2F] (gate first) -> out [F].
void swiglu_row(const float* gate_up, int64_t F, float* out);

}  // namespace specair
