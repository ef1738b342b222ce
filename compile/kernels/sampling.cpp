// See sampling.h. Tokens fall into bins of a quarter nat below the largest logit as their weights are taken;
// the fewest leading bins that hold the top-k set or reach top_p of the mass hold every token the filters
// can keep, and they are exactly the highest-ranked tokens, so only those are sorted. Should rounding leave
// the sorted prefix short, more bins are taken. Sums run in a fixed order, in double.
#include "sampling.h"

#include <algorithm>
#include <cmath>

#include "exp.h"

namespace specair {
namespace {

constexpr int kBins = 128;  // the last one holds everything below max - 31.75, -inf logits included
constexpr float kBinsPerNat = 4.0f;

inline int bin_of(float below_max) {
  const float b = -below_max * kBinsPerNat;
  return b < kBins - 1 ? static_cast<int>(b) : kBins - 1;
}

}  // namespace

void filtered_probs_row(const float* x, int64_t V, int64_t top_k, float top_p, float* probs, FilterScratch& s) {
  float m = -INFINITY;
  for (int64_t i = 0; i < V; ++i) m = std::max(m, x[i]);
  s.e.resize(static_cast<size_t>(V));
  float* e = s.e.data();
  const bool by_k = top_k > 0 && top_k < V, by_p = top_p < 1.0f;
  double lanes[4] = {0, 0, 0, 0}, mass[kBins] = {};
  int64_t count[kBins] = {};
  for (int64_t i = 0; i < V; ++i) {
    const float d = x[i] - m;
    e[i] = d >= kExpMin ? exp_nonpositive(d) : 0.0f;  // -inf logits (and weights below 1e-38) get none
    lanes[i & 3] += e[i];
  }
  const double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  if (!by_k && !by_p) {
    for (int64_t i = 0; i < V; ++i) probs[i] = static_cast<float>(e[i] / total);
    return;
  }
  for (int64_t i = 0; i < V; ++i) {
    const int b = bin_of(x[i] - m);
    ++count[b];
    mass[b] += e[i];
  }
  int bins = 0;
  for (double held = 0, n = 0; bins < kBins;) {
    held += mass[bins], n += count[bins++];
    if ((by_k && n >= top_k) || (by_p && held >= top_p * total * (1 + 1e-9))) break;
  }
  auto before = [x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  std::vector<int32_t>& c = s.candidates;
  int64_t kept = 0;
  for (;; bins = std::min(kBins, bins * 2)) {
    c.clear();
    for (int64_t i = 0; i < V; ++i)
      if (bin_of(x[i] - m) < bins) c.push_back(static_cast<int32_t>(i));
    std::sort(c.begin(), c.end(), before);
    const int64_t have = static_cast<int64_t>(c.size()), n = by_k ? std::min(top_k, have) : have;
    const bool whole = bins == kBins || (by_k && n == top_k);  // c holds every token the top-k filter keeps
    double z = total;
    if (by_k) {
      z = 0;
      for (int64_t j = 0; j < n; ++j) z += e[c[j]];
    }
    if (by_k && !whole) continue;  // z would miss top-k tokens outside the bins taken
    if (!by_p) {
      kept = n;
      break;
    }
    const double target = static_cast<double>(top_p) * z;
    double ahead = 0;  // the mass ranked before token j
    int64_t j = 0;
    while (j < n && (j == 0 || ahead < target)) ahead += e[c[j++]];  // the top token stays, even at top_p 0
    if (ahead >= target || whole) {
      kept = j;
      break;
    }
  }
  std::fill(probs, probs + V, 0.0f);
  double kept_mass = 0;
  for (int64_t j = 0; j < kept; ++j) kept_mass += e[c[j]];
  for (int64_t j = 0; j < kept; ++j) probs[c[j]] = static_cast<float>(e[c[j]] / kept_mass);
}

}  // namespace specair
