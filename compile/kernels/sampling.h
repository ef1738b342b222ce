// Top-k/top-p filtering without sorting the vocabulary: graphs/sampling.py's logits_to_probs for one row, in
// its order (top-k, then top-p over the top-k distribution, then renormalised), computed on the few tokens
// the filters can keep. Tokens rank by logit, ties by lower id; a token is kept while the mass ranked
// before it is below top_p. A row's bits depend on that row alone.
#pragma once
#include <cstdint>
#include <vector>

namespace specair {

struct FilterScratch {
  std::vector<float> e;
  std::vector<int32_t> candidates;
};

// probs[V] from temperature-scaled logits x[V]; top_k <= 0 or >= V and top_p >= 1 disable the filters.
void filtered_probs_row(const float* x, int64_t V, int64_t top_k, float top_p, float* probs, FilterScratch& s);

}  // namespace specair
