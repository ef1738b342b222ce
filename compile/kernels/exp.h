// exp(x) for x <= 0 (Cephes' expf: 2^n times a degree-7 polynomial of the remainder), shared by the kernels
// that take it in vector lanes (attention_simd.inc) and one element at a time (sampling.cpp).
#pragma once
#include <cstdint>
#include <cstring>

namespace specair {

constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f, kExpMin = -87.0f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// x in [kExpMin, 0]; n rounds x*log2(e) half away from zero (x <= 0), so |r| <= ln(2)/2.
inline float exp_nonpositive(float x) {
  const int32_t n = static_cast<int32_t>(x * kLog2e - 0.5f);
  const float fn = static_cast<float>(n);
  const float r = (x - fn * kLn2Hi) - fn * kLn2Lo;
  float p = kP[0];
  for (int i = 1; i < 6; ++i) p = p * r + kP[i];
  const float y = p * (r * r) + (r + 1.0f);
  const int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

}  // namespace specair
