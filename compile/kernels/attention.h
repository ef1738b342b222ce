// Attention of a step's T new tokens over a KV cache, row-independent: a query sees exactly the keys its
// causal mask and tree bias allow, visited in slot order, and keys it may not see are skipped, not added as
// zeros; the dot products, the softmax sum and the weighted sum of values run in that order. So a verify row
// computes, bit for bit, what a decode step computes for the same token over the same context.
#pragma once
#include <cstdint>

namespace specair {

struct AttentionArgs {
  const float *q, *k, *v;      // [B, T, H*D], [B, T, Hkv*D], [B, T, Hkv*D]: this step's tokens (RoPE applied)
  const float *k_cache, *v_cache;  // [B, Hkv, S, D]: committed slots 0 .. len-1
  const float* bias;           // [Bb, 1, T, S] additive (<= -1e30: hidden), or null; Bb is 1 or B
  int64_t bias_batch;
  const int32_t* seqlens;      // [B]: committed length + T - 1
  float* out;                  // [B, T, H*D]
  float *k_present, *v_present;  // [B, Hkv, S, D]: the cache with this step's K/V at slots len .. len+T-1
  int64_t B, T, H, Hkv, D, S;
  float scale;
};

// The instruction set attention runs on this CPU (avx512, avx2 or portable).
const char* attention_isa();

// Writes this step's K/V into the present caches (copying the past first where they are other buffers).
void attention_write_kv(const AttentionArgs& a);

// out for work items [begin, end) of B*H*T (one query head of one token each).
void attention_rows(const AttentionArgs& a, int64_t begin, int64_t end);

}  // namespace specair
