// onnxruntime custom-op library, domain specair.ort. onnxruntime hands over its API at load (RegisterCustomOps),
// so the library links nothing of onnxruntime and loads into the wheel's runtime.
//   MatMulBlocks(x [..., K] float, records uint8, super uint8 (K-quants) in blocks.h's layout; K, N, format)
//     -> [..., N]: a GGUF-quantized linear layer (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; F16, F32),
//     row-independent.
//   CacheAttention(q, k, v [B, T, *], k_cache, v_cache [B, Hkv, S, D], seqlens_k int32 [B], total int32,
//                  bias [Bb, 1, T, S]?; num_heads, kv_num_heads, scale) -> out [B, T, H*D], k_present, v_present:
//     GroupQueryAttention's contract (RoPE applied before), computed row-independently (attention.h).
//   FilteredProbs(x [B, ..., V] float, top_k int64 [B], top_p float [B]) -> probs [B, ..., V]: row b's filters
//     on each of its rows (sampling.h).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <mutex>
#include <string>
#include <vector>

#include "attention.h"
#include "blocks.h"
#include "sampling.h"

namespace {

constexpr int64_t kTilesPerTask = 4;

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

struct BlocksKernel {
  const OrtApi& api;
  int format = -1;
  int64_t K = 0, N = 0;
  std::vector<int8_t> q8;
  std::vector<float> scale, sum;
  std::vector<int32_t> isum;

  OrtStatusPtr error(const std::string& what) const {
    return api.CreateStatus(ORT_INVALID_ARGUMENT, ("specair MatMulBlocks: " + what).c_str());
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue x = ctx.GetInput(0), records = ctx.GetInput(1);
    const specair::FormatInfo& info = specair::format_info(format);
    std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() != K)
      return error("x's last dimension must be K = " + std::to_string(K));
    const int64_t tiles = (N + specair::kTile - 1) / specair::kTile, nb = K / specair::kBlock;
    const uint8_t* super = nullptr;
    if (info.super) {
      const Ort::ConstValue s = ctx.GetInputCount() > 2 ? ctx.GetInput(2) : Ort::ConstValue{nullptr};
      if (!s || s.GetTensorTypeAndShapeInfo().GetElementCount() !=
                    static_cast<size_t>(tiles * (nb / specair::kSuper) * info.super))
        return error(std::string(info.name) + " super-block parameters do not match K and N");
      super = s.GetTensorData<uint8_t>();
    }
    if (records.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(tiles * nb * info.record))
      return error(std::string(info.name) + " blocks do not match K = " + std::to_string(K) + ", N = " +
                   std::to_string(N));
    int64_t M = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) M *= shape[i];
    shape.back() = N;
    Ort::UnownedValue y = ctx.GetOutput(0, shape);
    if (M == 0) return nullptr;
    if (!specair::is_float(format)) {
      q8.resize(static_cast<size_t>(M * K));
      scale.resize(static_cast<size_t>(M * nb));
      sum.resize(static_cast<size_t>(M * nb));
      isum.resize(static_cast<size_t>(2 * M * nb));
      specair::quantize_rows(x.GetTensorData<float>(), M, K, q8.data(), scale.data(), sum.data(), isum.data());
    }
    Task task{format, {q8.data(), scale.data(), sum.data(), isum.data()}, x.GetTensorData<float>(), M, K, N, tiles,
              records.GetTensorData<uint8_t>(), super, y.GetTensorMutableData<float>()};
    const size_t tasks = static_cast<size_t>((tiles + kTilesPerTask - 1) / kTilesPerTask);
    return api.KernelContext_ParallelFor(context, run_task, tasks, 0, &task);
  }
};

struct BlocksOp : Ort::CustomOpBase<BlocksOp, BlocksKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    auto* k = new BlocksKernel{api};
    if (auto* s = api.KernelInfoGetAttribute_int64(info, "K", &k->K)) return delete k, s;
    if (auto* s = api.KernelInfoGetAttribute_int64(info, "N", &k->N)) return delete k, s;
    char name[16] = {0};
    size_t size = sizeof name;
    if (auto* s = api.KernelInfoGetAttribute_string(info, "format", name, &size)) return delete k, s;
    k->format = specair::format_by_name(name);
    if (k->format < 0) {
      delete k;
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (std::string("specair MatMulBlocks: unknown format ") + name).c_str());
    }
    const int64_t step = specair::format_info(k->format).super ? specair::kBlock * specair::kSuper : specair::kBlock;
    if (k->K <= 0 || k->K % step || k->N <= 0) {
      delete k;
      return api.CreateStatus(ORT_INVALID_ARGUMENT, ("specair MatMulBlocks: K must be a positive multiple of " +
                                                     std::to_string(step) + " for " + name).c_str());
    }
    *kernel = k;
    return nullptr;
  }
  const char* GetName() const { return "MatMulBlocks"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 2 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

void run_attention(void* data, size_t i) {
  const auto& a = *static_cast<const specair::AttentionArgs*>(data);
  specair::attention_rows(a, static_cast<int64_t>(i), static_cast<int64_t>(i) + 1);
}

struct AttentionKernel {
  const OrtApi& api;
  int64_t heads = 0, kv_heads = 0;
  float scale = 0.0f;

  OrtStatusPtr error(const std::string& what) const {
    return api.CreateStatus(ORT_INVALID_ARGUMENT, ("specair CacheAttention: " + what).c_str());
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const auto q = ctx.GetInput(0), k = ctx.GetInput(1), v = ctx.GetInput(2), kc = ctx.GetInput(3),
               vc = ctx.GetInput(4), lens = ctx.GetInput(5);
    const auto qs = q.GetTensorTypeAndShapeInfo().GetShape(), cs = kc.GetTensorTypeAndShapeInfo().GetShape();
    if (qs.size() != 3 || cs.size() != 4 || cs[1] != kv_heads || qs[2] != heads * cs[3] || cs[0] != qs[0])
      return error("q must be [B, T, H*D] and the caches [B, Hkv, S, D]");
    specair::AttentionArgs a{};
    a.B = qs[0], a.T = qs[1], a.H = heads, a.Hkv = kv_heads, a.D = cs[3], a.S = cs[2], a.scale = scale;
    if (lens.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(a.B))
      return error("seqlens_k must hold one length per row");
    a.seqlens = lens.GetTensorData<int32_t>();
    for (int64_t b = 0; b < a.B; ++b)
      if (a.seqlens[b] + 1 < a.T || a.seqlens[b] + 1 > a.S) return error("a row's length is outside its cache");
    a.q = q.GetTensorData<float>(), a.k = k.GetTensorData<float>(), a.v = v.GetTensorData<float>();
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
  size_t GetInputTypeCount() const { return 8; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 5 || i == 6 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 7 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
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
  static AttentionOp attention;
  static FilterOp filter;
  static Ort::CustomOpDomain* domain = nullptr;
  std::call_once(once, [base] {
    Ort::InitApi(base->GetApi(ORT_API_VERSION));
    domain = new Ort::CustomOpDomain("specair.ort");  // lives as long as the process: sessions keep using it
    domain->Add(&op);
    domain->Add(&attention);
    domain->Add(&filter);
  });
  return Ort::GetApi().AddCustomOpDomain(options, *domain);
}

}  // extern "C"
