// onnxruntime custom-op library, domain specair.ort. onnxruntime hands over its API at load (RegisterCustomOps),
// so the library links nothing of onnxruntime and loads into the wheel's runtime.
//   MatMulBlocks(x [..., K] float, records uint8, super uint8 (K-quants) in blocks.h's layout; K, N, format)
//     -> [..., N]: a GGUF-quantized linear layer (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; F16, F32),
//     row-independent.
//   GatherBlocks(indices int64 [...], records, super; K, N, format) -> [..., K]: rows of such a table (an
//     embedding), dequantized exactly.
//   CacheAttention(q, k, v [B, T, *], k_cache, v_cache [B, Hkv, S, D], seqlens_k int32 [B], total int32,
//                  bias [Bb, 1, T, S]?; num_heads, kv_num_heads, scale) -> out [B, T, H*D], k_present, v_present:
//     GroupQueryAttention's contract (RoPE applied before), computed row-independently (attention.h); with
//     do_rotary, q is the packed q|k|v before RoPE, rotated here by positions [B, T] and cos/sin [P, D/2],
//     after a per-head RMSNorm of q and k where q_norm and k_norm [D] (and epsilon) are given.
//   FilteredProbs(x [B, ..., V] float, top_k int64 [B], top_p float [B]) -> probs [B, ..., V]: row b's filters
//     on each of its rows (sampling.h).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "attention.h"
#include "blocks.h"
#include "rowwise.h"
#include "sampling.h"

namespace {

constexpr int64_t kTilesPerTask = 4;

// Parts a product splits into: one contiguous run of tiles per thread of the pool (the session option
// specair.intra_op_threads; else every hardware thread; 0: small tasks taken in turn). As small tasks, the
// threads' weight reads interleave, which streams markedly slower here (docs/performance.md).
std::atomic<size_t> g_parts{0};

// A table of `format` [N][K] in blocks.h's layout: the records (input 1) and, for the K-quants, the
// super-block parameters (input 2, returned in *super) must be its sizes; what is wrong, else "".
std::string check_layout(Ort::KernelContext& ctx, int format, int64_t K, int64_t N, const uint8_t** super) {
  const specair::FormatInfo& info = specair::format_info(format);
  const int64_t tiles = (N + specair::kTile - 1) / specair::kTile, nb = K / specair::kBlock;
  if (info.super) {
    const Ort::ConstValue s = ctx.GetInputCount() > 2 ? ctx.GetInput(2) : Ort::ConstValue{nullptr};
    if (!s || s.GetTensorTypeAndShapeInfo().GetElementCount() !=
                  static_cast<size_t>(tiles * (nb / specair::kSuper) * info.super))
      return std::string(info.name) + " super-block parameters do not match K and N";
    *super = s.GetTensorData<uint8_t>();
  }
  if (ctx.GetInput(1).GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(tiles * nb * info.record))
    return std::string(info.name) + " blocks do not match K = " + std::to_string(K) + ", N = " + std::to_string(N);
  return "";
}

// The K, N and format attributes of an op over a block table (`op` names it in errors), checked: a known
// format, K a positive multiple of its block (of its super-block for the K-quants), N positive.
OrtStatusPtr table_attributes(const OrtApi& api, const OrtKernelInfo* info, const char* op, int64_t& K, int64_t& N,
                              int& format) {
  if (auto* s = api.KernelInfoGetAttribute_int64(info, "K", &K)) return s;
  if (auto* s = api.KernelInfoGetAttribute_int64(info, "N", &N)) return s;
  char name[16] = {0};
  size_t size = sizeof name;
  if (auto* s = api.KernelInfoGetAttribute_string(info, "format", name, &size)) return s;
  format = specair::format_by_name(name);
  const std::string where = std::string("specair ") + op + ": ";
  if (format < 0) return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "unknown format " + name).c_str());
  const int64_t step = specair::format_info(format).super ? specair::kBlock * specair::kSuper : specair::kBlock;
  if (K <= 0 || K % step || N <= 0)
    return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "K must be a positive multiple of " + std::to_string(step) +
                                                   " for " + name + ", N positive").c_str());
  return nullptr;
}

struct Task {
  int format;
  specair::Q8Rows x;
  const float* xf;
  int64_t M, K, N, tiles;
  const uint8_t *records, *super;
  float* y;
};

void run_task(void* data, size_t i) {
  const Task& t = *static_cast<const Task*>(data);
  const int64_t begin = static_cast<int64_t>(i) * kTilesPerTask;
  specair::blocks_tiles(t.format, t.x, t.xf, t.M, t.K, t.N, t.records, t.super, t.y, begin,
                        std::min(t.tiles, begin + kTilesPerTask));
}

enum Prologue { kNone, kRmsNorm, kSwiGlu };

struct BlocksKernel {
  const OrtApi& api;
  int format = -1;
  int64_t K = 0, N = 0;
  Prologue prologue = kNone;
  size_t parts = 0;
  float eps = 0.0f;
  std::vector<int8_t> q8;
  std::vector<float> scale, sum, rows;
  std::vector<int32_t> isum;

  OrtStatusPtr error(const std::string& what) const {
    return api.CreateStatus(ORT_INVALID_ARGUMENT, ("specair MatMulBlocks: " + what).c_str());
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue x = ctx.GetInput(0), records = ctx.GetInput(1);
    std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t width = prologue == kSwiGlu ? 2 * K : K;
    if (shape.empty() || shape.back() != width)
      return error("x's last dimension must be " + std::to_string(width) + (prologue == kSwiGlu ? " (2K)" : " (K)"));
    const uint8_t* super = nullptr;
    if (std::string e = check_layout(ctx, format, K, N, &super); !e.empty()) return error(e);
    const int64_t tiles = (N + specair::kTile - 1) / specair::kTile, nb = K / specair::kBlock;
    int64_t M = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) M *= shape[i];
    shape.back() = N;
    const float* residual = nullptr;
    if (ctx.GetInputCount() > 4) {
      const Ort::ConstValue r = ctx.GetInput(4);
      if (r) {
        if (r.GetTensorTypeAndShapeInfo().GetShape() != shape) return error("the residual must have the output's shape");
        residual = r.GetTensorData<float>();
      }
    }
    Ort::UnownedValue y = ctx.GetOutput(0, shape);
    if (M == 0) return nullptr;
    const float* xf = x.GetTensorData<float>();
    if (prologue != kNone) {  // each row through RMSNorm or SwiGLU first, as the unfused operator computes it
      rows.resize(static_cast<size_t>(M * K));
      const float* w = nullptr;
      if (prologue == kRmsNorm) {
        const Ort::ConstValue nw = ctx.GetInputCount() > 3 ? ctx.GetInput(3) : Ort::ConstValue{nullptr};
        if (!nw || nw.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(K))
          return error("rmsnorm needs its weight [K]");
        w = nw.GetTensorData<float>();
      }
      for (int64_t m = 0; m < M; ++m) {
        if (prologue == kRmsNorm)
          specair::rms_norm_row(xf + m * K, w, eps, K, rows.data() + m * K);
        else
          specair::swiglu_row(xf + m * 2 * K, K, rows.data() + m * K);
      }
      xf = rows.data();
    }
    if (!specair::is_float(format)) {
      q8.resize(static_cast<size_t>(M * K));
      scale.resize(static_cast<size_t>(M * nb));
      sum.resize(static_cast<size_t>(M * nb));
      isum.resize(static_cast<size_t>(2 * M * nb));
      specair::quantize_rows(xf, M, K, q8.data(), scale.data(), sum.data(), isum.data());
    }
    float* out = y.GetTensorMutableData<float>();
    Task task{format, {q8.data(), scale.data(), sum.data(), isum.data()}, xf, M, K, N, tiles,
              records.GetTensorData<uint8_t>(), super, out};
    const size_t tasks = static_cast<size_t>((tiles + kTilesPerTask - 1) / kTilesPerTask);
    if (OrtStatusPtr s = api.KernelContext_ParallelFor(context, run_task, tasks, std::min(parts, tasks), &task)) return s;
    if (residual)
      for (int64_t i = 0; i < M * N; ++i) out[i] = residual[i] + out[i];
    return nullptr;
  }
};

struct BlocksOp : Ort::CustomOpBase<BlocksOp, BlocksKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    auto* k = new BlocksKernel{api};
    k->parts = g_parts.load();
    if (auto* s = table_attributes(api, info, "MatMulBlocks", k->K, k->N, k->format)) return delete k, s;
    char pro[16] = {0};
    size_t size = sizeof pro;
    if (auto* s = api.KernelInfoGetAttribute_string(info, "prologue", pro, &size)) {
      api.ReleaseStatus(s);  // optional: none
    } else if (std::string(pro) == "rmsnorm" || std::string(pro) == "swiglu") {
      k->prologue = std::string(pro) == "rmsnorm" ? kRmsNorm : kSwiGlu;
    } else if (std::string(pro) != "none") {
      delete k;
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (std::string("specair MatMulBlocks: unknown prologue ") + pro).c_str());
    }
    if (auto* s = api.KernelInfoGetAttribute_float(info, "epsilon", &k->eps)) api.ReleaseStatus(s);
    *kernel = k;
    return nullptr;
  }
  const char* GetName() const { return "MatMulBlocks"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  // x, records, super (K-quants), the prologue's RMSNorm weight, a residual added to the output
  size_t GetInputTypeCount() const { return 5; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 || i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 2 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

// Rows of a block-quantized table (an embedding), dequantized as blocks_dequantize would: Gather's contract
// for axis 0 (an index in [-N, N)), on the table as MatMulBlocks reads it, so no float copy of it is held.
struct GatherKernel {
  const OrtApi& api;
  int format = -1;
  int64_t K = 0, N = 0;

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue ids = ctx.GetInput(0), records = ctx.GetInput(1);
    const uint8_t* super = nullptr;
    if (std::string e = check_layout(ctx, format, K, N, &super); !e.empty()) return error(e);
    std::vector<int64_t> shape = ids.GetTensorTypeAndShapeInfo().GetShape();
    const size_t count = ids.GetTensorTypeAndShapeInfo().GetElementCount();
    shape.push_back(K);
    float* out = ctx.GetOutput(0, shape).GetTensorMutableData<float>();
    const int64_t* id = ids.GetTensorData<int64_t>();
    for (size_t i = 0; i < count; ++i) {
      const int64_t n = id[i] < 0 ? id[i] + N : id[i];
      if (n < 0 || n >= N) return error("index " + std::to_string(id[i]) + " is outside the table's " + std::to_string(N) + " rows");
      specair::blocks_row(format, K, records.GetTensorData<uint8_t>(), super, n, out + i * K);
    }
    return nullptr;
  }

  OrtStatusPtr error(const std::string& what) const {
    return api.CreateStatus(ORT_INVALID_ARGUMENT, ("specair GatherBlocks: " + what).c_str());
  }
};

struct GatherOp : Ort::CustomOpBase<GatherOp, GatherKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    auto* k = new GatherKernel{api};
    if (auto* s = table_attributes(api, info, "GatherBlocks", k->K, k->N, k->format)) return delete k, s;
    *kernel = k;
    return nullptr;
  }
  const char* GetName() const { return "GatherBlocks"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }  // indices, records, super (K-quants)
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 2 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

struct RowsKernel {
  const OrtApi& api;
  bool glu = false;
  float eps = 0.0f;

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue x = ctx.GetInput(0);
    std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    const char* name = glu ? "specair SwiGLU: " : "specair RMSNorm: ";
    if (shape.empty() || (glu && shape.back() % 2))
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (std::string(name) + "bad input shape").c_str());
    const int64_t in = shape.back(), out_w = glu ? in / 2 : in;
    int64_t M = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) M *= shape[i];
    const float* w = nullptr;
    if (!glu) {
      const Ort::ConstValue weight = ctx.GetInput(1);
      if (weight.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(in))
        return api.CreateStatus(ORT_INVALID_ARGUMENT, (std::string(name) + "the weight must match the last dimension").c_str());
      w = weight.GetTensorData<float>();
    }
    shape.back() = out_w;
    float* out = ctx.GetOutput(0, shape).GetTensorMutableData<float>();
    const float* xf = x.GetTensorData<float>();
    for (int64_t m = 0; m < M; ++m) {
      if (glu)
        specair::swiglu_row(xf + m * in, out_w, out + m * out_w);
      else
        specair::rms_norm_row(xf + m * in, w, eps, in, out + m * in);
    }
    return nullptr;
  }
};

template <bool kGlu>
struct RowsOp : Ort::CustomOpBase<RowsOp<kGlu>, RowsKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    auto* k = new RowsKernel{api, kGlu};
    if (!kGlu)
      if (auto* s = api.KernelInfoGetAttribute_float(info, "epsilon", &k->eps)) return delete k, s;
    *kernel = k;
    return nullptr;
  }
  const char* GetName() const { return kGlu ? "SwiGLU" : "RMSNorm"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return kGlu ? 1 : 2; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

void run_attention(void* data, size_t i) {
  const auto& a = *static_cast<const specair::AttentionArgs*>(data);
  specair::attention_rows(a, static_cast<int64_t>(i), static_cast<int64_t>(i) + 1);
}

struct AttentionKernel {
  const OrtApi& api;
  int64_t heads = 0, kv_heads = 0, rotary = 0;
  float scale = 0.0f, eps = 0.0f;
  std::vector<float> q_rot, k_rot, v_buf, normed;

  // do_rotary: q, k and v come packed in input 0 [B, T, (H + 2 Hkv) * D] before RoPE; rotate q and k (HF's
  // rotate-half pairs, cos/sin [P, D/2] at positions [B, T]) and unpack v, as RotaryEmbedding and Split would.
  // With q_norm and k_norm (inputs 11, 12: [D], Qwen3's), each head of q and k goes through RMSNorm first, as
  // the RMSNorm op computes it.
  OrtStatusPtr unpack(Ort::KernelContext& ctx, const Ort::ConstValue& qkv, int64_t B, int64_t T, int64_t D) {
    const auto pos = ctx.GetInput(8), cos = ctx.GetInput(9), sin = ctx.GetInput(10);
    if (!pos || !cos || !sin) return error("do_rotary needs positions, cos and sin");
    const auto ts = cos.GetTensorTypeAndShapeInfo().GetShape();
    if (ts.size() != 2 || ts[1] * 2 != D || pos.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(B * T))
      return error("cos/sin must be [P, D/2] and positions [B, T]");
    const float *qn = nullptr, *kn = nullptr;
    if (ctx.GetInputCount() > 12) {
      const auto qw = ctx.GetInput(11), kw = ctx.GetInput(12);
      if (static_cast<bool>(qw) != static_cast<bool>(kw)) return error("q_norm and k_norm come together");
      if (qw) {
        if (qw.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(D) ||
            kw.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(D))
          return error("q_norm and k_norm must be [head_dim]");
        qn = qw.GetTensorData<float>(), kn = kw.GetTensorData<float>();
        normed.resize(static_cast<size_t>(D));
      }
    }
    const int64_t H = heads, Hkv = kv_heads, W = (H + 2 * Hkv) * D, half = D / 2, P = ts[0];
    q_rot.resize(static_cast<size_t>(B * T * H * D));
    k_rot.resize(static_cast<size_t>(B * T * Hkv * D));
    v_buf.resize(static_cast<size_t>(B * T * Hkv * D));
    const float *x = qkv.GetTensorData<float>(), *c = cos.GetTensorData<float>(), *sn = sin.GetTensorData<float>();
    const int64_t* p = pos.GetTensorData<int64_t>();
    for (int64_t bt = 0; bt < B * T; ++bt) {
      if (p[bt] < 0 || p[bt] >= P) return error("a position is outside the RoPE tables");
      const float *cr = c + p[bt] * half, *sr = sn + p[bt] * half, *row = x + bt * W;
      const auto rotate = [&](const float* src, float* dst, const float* norm) {
        if (norm) {
          specair::rms_norm_row(src, norm, eps, D, normed.data());
          src = normed.data();
        }
        for (int64_t i = 0; i < half; ++i) {
          dst[i] = src[i] * cr[i] - src[half + i] * sr[i];
          dst[half + i] = src[half + i] * cr[i] + src[i] * sr[i];
        }
      };
      for (int64_t h = 0; h < H; ++h) rotate(row + h * D, q_rot.data() + (bt * H + h) * D, qn);
      for (int64_t h = 0; h < Hkv; ++h) rotate(row + (H + h) * D, k_rot.data() + (bt * Hkv + h) * D, kn);
      std::copy(row + (H + Hkv) * D, row + W, v_buf.data() + bt * Hkv * D);
    }
    return nullptr;
  }

  OrtStatusPtr error(const std::string& what) const {
    return api.CreateStatus(ORT_INVALID_ARGUMENT, ("specair CacheAttention: " + what).c_str());
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const auto q = ctx.GetInput(0), kc = ctx.GetInput(3), vc = ctx.GetInput(4), lens = ctx.GetInput(5);
    auto qs = q.GetTensorTypeAndShapeInfo().GetShape();
    const auto cs = kc.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t width = rotary ? (heads + 2 * kv_heads) * (cs.size() == 4 ? cs[3] : 0) : heads * (cs.size() == 4 ? cs[3] : 0);
    if (qs.size() != 3 || cs.size() != 4 || cs[1] != kv_heads || qs[2] != width || cs[0] != qs[0])
      return error(rotary ? "qkv must be [B, T, (H + 2 Hkv) * D] and the caches [B, Hkv, S, D]"
                          : "q must be [B, T, H*D] and the caches [B, Hkv, S, D]");
    specair::AttentionArgs a{};
    a.B = qs[0], a.T = qs[1], a.H = heads, a.Hkv = kv_heads, a.D = cs[3], a.S = cs[2], a.scale = scale;
    if (lens.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(a.B))
      return error("seqlens_k must hold one length per row");
    a.seqlens = lens.GetTensorData<int32_t>();
    for (int64_t b = 0; b < a.B; ++b)
      if (a.seqlens[b] + 1 < a.T || a.seqlens[b] + 1 > a.S) return error("a row's length is outside its cache");
    if (rotary) {
      if (OrtStatusPtr s = unpack(ctx, q, a.B, a.T, a.D)) return s;
      a.q = q_rot.data(), a.k = k_rot.data(), a.v = v_buf.data();
      qs[2] = heads * a.D;
    } else {
      a.q = q.GetTensorData<float>(), a.k = ctx.GetInput(1).GetTensorData<float>();
      a.v = ctx.GetInput(2).GetTensorData<float>();
    }
    a.k_cache = kc.GetTensorData<float>(), a.v_cache = vc.GetTensorData<float>();
    if (ctx.GetInputCount() > 7) {
      const auto bias = ctx.GetInput(7);
      if (bias) {
        const auto bs = bias.GetTensorTypeAndShapeInfo().GetShape();
        if (bs.size() != 4 || (bs[0] != 1 && bs[0] != a.B) || bs[2] != a.T || bs[3] != a.S)
          return error("attention_bias must be [1 or B, 1, T, S]");
        a.bias = bias.GetTensorData<float>(), a.bias_batch = bs[0];
      }
    }
    a.out = ctx.GetOutput(0, qs).GetTensorMutableData<float>();
    a.k_present = ctx.GetOutput(1, cs).GetTensorMutableData<float>();
    a.v_present = ctx.GetOutput(2, cs).GetTensorMutableData<float>();
    specair::attention_write_kv(a);
    return api.KernelContext_ParallelFor(context, run_attention, static_cast<size_t>(a.B * a.H * a.T), 0, &a);
  }
};

struct AttentionOp : Ort::CustomOpBase<AttentionOp, AttentionKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    auto* k = new AttentionKernel{api};
    if (auto* s = api.KernelInfoGetAttribute_int64(info, "num_heads", &k->heads)) return delete k, s;
    if (auto* s = api.KernelInfoGetAttribute_int64(info, "kv_num_heads", &k->kv_heads)) return delete k, s;
    if (auto* s = api.KernelInfoGetAttribute_float(info, "scale", &k->scale)) return delete k, s;
    if (auto* s = api.KernelInfoGetAttribute_int64(info, "do_rotary", &k->rotary)) api.ReleaseStatus(s);
    if (auto* s = api.KernelInfoGetAttribute_float(info, "epsilon", &k->eps)) api.ReleaseStatus(s);
    if (k->heads <= 0 || k->kv_heads <= 0 || k->heads % k->kv_heads) {
      delete k;
      return api.CreateStatus(ORT_INVALID_ARGUMENT, "specair CacheAttention: num_heads must be a multiple of "
                                                    "kv_num_heads");
    }
    *kernel = k;
    return nullptr;
  }
  const char* GetName() const { return "CacheAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  // q, k, v, k_cache, v_cache, seqlens_k, total, attention_bias; with do_rotary q is the packed q|k|v (k and
  // v empty) and positions, cos and sin follow, then the per-head q_norm and k_norm weights where there are any
  size_t GetInputTypeCount() const { return 13; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 5 || i == 6 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32
         : i == 8           ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 1 || i == 2 || i >= 7 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

struct FilterTask {
  const float* x;
  const int64_t* top_k;
  const float* top_p;
  float* probs;
  int64_t V, rows_per_b;
};

void run_filter(void* data, size_t i) {
  const auto& t = *static_cast<const FilterTask*>(data);
  thread_local specair::FilterScratch scratch;
  const int64_t r = static_cast<int64_t>(i), b = r / t.rows_per_b;
  specair::filtered_probs_row(t.x + r * t.V, t.V, t.top_k[b], t.top_p[b], t.probs + r * t.V, scratch);
}

struct FilterKernel {
  const OrtApi& api;

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const auto x = ctx.GetInput(0), k = ctx.GetInput(1), p = ctx.GetInput(2);
    const std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    const size_t B = k.GetTensorTypeAndShapeInfo().GetElementCount();
    if (shape.size() < 2 || shape[0] != static_cast<int64_t>(B) || p.GetTensorTypeAndShapeInfo().GetElementCount() != B)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, "specair FilteredProbs: x must be [B, ..., V] with top_k and "
                                                    "top_p [B]");
    int64_t rows = 1;
    for (size_t d = 0; d + 1 < shape.size(); ++d) rows *= shape[d];
    FilterTask t{x.GetTensorData<float>(), k.GetTensorData<int64_t>(), p.GetTensorData<float>(),
                 ctx.GetOutput(0, shape).GetTensorMutableData<float>(), shape.back(),
                 B ? rows / static_cast<int64_t>(B) : 0};
    if (rows == 0) return nullptr;
    return api.KernelContext_ParallelFor(context, run_filter, static_cast<size_t>(rows), 0, &t);
  }
};

struct FilterOp : Ort::CustomOpBase<FilterOp, FilterKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo*, void** kernel) const {
    *kernel = new FilterKernel{api};
    return nullptr;
  }
  const char* GetName() const { return "FilteredProbs"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

extern "C" {

__attribute__((visibility("default"))) const char* specair_blocks_isa() { return specair::blocks_isa(); }
__attribute__((visibility("default"))) int specair_blocks_dequantize(const char* format, int64_t K, int64_t N,
                                                                     const uint8_t* records, const uint8_t* super,
                                                                     float* w) {
  const int f = specair::format_by_name(format);
  if (f < 0) return -1;
  specair::blocks_dequantize(f, K, N, records, super, w);
  return 0;
}
__attribute__((visibility("default"))) const char* specair_attention_isa() { return specair::attention_isa(); }

__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                 const OrtApiBase* base) {
  static std::once_flag once;
  static BlocksOp op;
  static GatherOp gather;
  static AttentionOp attention;
  static FilterOp filter;
  static RowsOp<false> norm;
  static RowsOp<true> glu;
  static Ort::CustomOpDomain* domain = nullptr;
  std::call_once(once, [base] {
    Ort::InitApi(base->GetApi(ORT_API_VERSION));
    domain = new Ort::CustomOpDomain("specair.ort");  // lives as long as the process: sessions keep using it
    domain->Add(&op);
    domain->Add(&gather);
    domain->Add(&attention);
    domain->Add(&filter);
    domain->Add(&norm);
    domain->Add(&glu);
  });
  const OrtApi& api = Ort::GetApi();
  const char* key = "specair.intra_op_threads";
  int has = 0;
  size_t parts = std::max(1u, std::thread::hardware_concurrency());
  if (OrtStatus* s = api.HasSessionConfigEntry(options, key, &has)) return s;
  if (has) {
    char value[32] = {0};
    size_t size = sizeof value;
    if (OrtStatus* s = api.GetSessionConfigEntry(options, key, value, &size)) return s;
    char* end = nullptr;
    const long n = std::strtol(value, &end, 10);
    if (end == value || *end || n < 0)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (std::string(key) + " must be a count of threads").c_str());
    parts = static_cast<size_t>(n);
  }
  g_parts.store(parts);
  return api.AddCustomOpDomain(options, *domain);
}

}  // extern "C"
