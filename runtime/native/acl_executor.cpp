// AscendCL executor (Atlas edge boards): the ATC `.om` models made from `specair compile --backend onnx
// --self-contained` graphs, one per graph name (`<om-dir>/<graph>.om`), weights inside each model.
//
// Built only when CMake finds a CANN toolkit. Inputs are copied host → device before each execution and
// outputs device → host after it (the KV caches included), in the order of the graph's named inputs and
// outputs, which the ONNX export and ATC keep. Unverified: no CANN toolkit or board was available where
// this was written, so it has never been compiled or run.
#include <acl/acl.h>

#include <mutex>

#include "runner.h"

namespace specair {

namespace {

void check(aclError rc, const std::string& what) {
  if (rc != ACL_SUCCESS) throw std::runtime_error("AscendCL: " + what + " failed with error " + std::to_string(rc));
}

at::ScalarType from_acl(aclDataType t) {
  switch (t) {
    case ACL_FLOAT: return at::kFloat;
    case ACL_FLOAT16: return at::kHalf;
    case ACL_BF16: return at::kBFloat16;
    case ACL_DOUBLE: return at::kDouble;
    case ACL_INT64: return at::kLong;
    case ACL_INT32: return at::kInt;
    case ACL_INT16: return at::kShort;
    case ACL_INT8: return at::kChar;
    case ACL_UINT8: return at::kByte;
    case ACL_BOOL: return at::kBool;
    default: throw std::runtime_error("AscendCL: unsupported output data type " + std::to_string(int(t)));
  }
}

struct Model {
  uint32_t id = 0;
  aclmdlDesc* desc = nullptr;
  std::vector<void*> in_dev, out_dev;
  std::vector<size_t> in_size, out_size;
};

class AclExecutor : public Executor {
 public:
  AclExecutor(const Artifacts& art, fs::path om_dir, int device)
      : art_(art), om_dir_(std::move(om_dir)), device_(device) {
    check(aclInit(nullptr), "aclInit");
    check(aclrtSetDevice(device_), "aclrtSetDevice");
    check(aclrtCreateContext(&context_, device_), "aclrtCreateContext");
    for (const auto& [name, io] : art.graphs)
      if (!fs::is_regular_file(om_dir_ / (name + ".om")))
        throw InputError("no " + name + ".om in " + om_dir_.string() + ": convert " + name +
                         ".onnx with atc (README: Atlas edge boards)");
  }

  ~AclExecutor() override {
    aclrtSetCurrentContext(context_);
    for (auto& [name, m] : models_) {
      for (void* p : m.in_dev) aclrtFree(p);
      for (void* p : m.out_dev) aclrtFree(p);
      aclmdlUnload(m.id);
      aclmdlDestroyDesc(m.desc);
    }
    aclrtDestroyContext(context_);
    aclrtResetDevice(device_);
    aclFinalize();
  }

  Tensors run(const std::string& graph, Tensors inputs) override {
    std::lock_guard<std::mutex> lock(mutex_);  // one model id across threads needs a lock
    check(aclrtSetCurrentContext(context_), "aclrtSetCurrentContext");
    Model& m = load(graph);
    if (inputs.size() != m.in_size.size())
      throw std::runtime_error(graph + ".om takes " + std::to_string(m.in_size.size()) + " inputs, got " +
                               std::to_string(inputs.size()));
    aclmdlDataset* in = aclmdlCreateDataset();
    aclmdlDataset* out = aclmdlCreateDataset();
    std::vector<aclDataBuffer*> buffers;
    for (size_t i = 0; i < inputs.size(); ++i) {
      at::Tensor t = inputs[i].contiguous();
      if (t.nbytes() != m.in_size[i])
        throw std::runtime_error(graph + ".om input " + std::to_string(i) + " holds " + std::to_string(m.in_size[i]) +
                                 " bytes, the runner passes " + std::to_string(t.nbytes()));
      check(aclrtMemcpy(m.in_dev[i], m.in_size[i], t.data_ptr(), t.nbytes(), ACL_MEMCPY_HOST_TO_DEVICE),
            "aclrtMemcpy");
      buffers.push_back(aclCreateDataBuffer(m.in_dev[i], m.in_size[i]));
      aclmdlAddDatasetBuffer(in, buffers.back());
    }
    for (size_t i = 0; i < m.out_size.size(); ++i) {
      buffers.push_back(aclCreateDataBuffer(m.out_dev[i], m.out_size[i]));
      aclmdlAddDatasetBuffer(out, buffers.back());
    }
    aclError rc = aclmdlExecute(m.id, in, out);
    for (auto* b : buffers) aclDestroyDataBuffer(b);
    aclmdlDestroyDataset(in);
    aclmdlDestroyDataset(out);
    check(rc, "aclmdlExecute(" + graph + ")");
    Tensors outputs;
    for (size_t i = 0; i < m.out_size.size(); ++i) {
      aclmdlIODims dims;
      check(aclmdlGetOutputDims(m.desc, i, &dims), "aclmdlGetOutputDims");
      std::vector<int64_t> shape(dims.dims, dims.dims + dims.dimCount);
      at::Tensor t = at::empty(shape, at::TensorOptions().dtype(from_acl(aclmdlGetOutputDataType(m.desc, i))));
      check(aclrtMemcpy(t.data_ptr(), t.nbytes(), m.out_dev[i], m.out_size[i], ACL_MEMCPY_DEVICE_TO_HOST),
            "aclrtMemcpy");
      outputs.push_back(t);
    }
    return outputs;
  }

 private:
  Model& load(const std::string& graph) {
    auto it = models_.find(graph);
    if (it != models_.end()) return it->second;
    Model m;
    std::string path = (om_dir_ / (graph + ".om")).string();
    check(aclmdlLoadFromFile(path.c_str(), &m.id), "aclmdlLoadFromFile(" + path + ")");
    m.desc = aclmdlCreateDesc();
    check(aclmdlGetDesc(m.desc, m.id), "aclmdlGetDesc");
    for (size_t i = 0; i < aclmdlGetNumInputs(m.desc); ++i) {
      m.in_size.push_back(aclmdlGetInputSizeByIndex(m.desc, i));
      m.in_dev.push_back(nullptr);
      check(aclrtMalloc(&m.in_dev.back(), m.in_size.back(), ACL_MEM_MALLOC_HUGE_FIRST), "aclrtMalloc");
    }
    for (size_t i = 0; i < aclmdlGetNumOutputs(m.desc); ++i) {
      m.out_size.push_back(aclmdlGetOutputSizeByIndex(m.desc, i));
      m.out_dev.push_back(nullptr);
      check(aclrtMalloc(&m.out_dev.back(), m.out_size.back(), ACL_MEM_MALLOC_HUGE_FIRST), "aclrtMalloc");
    }
    if (m.out_size.size() != art_.graph(graph).outputs.size())
      throw InputError(graph + ".om has " + std::to_string(m.out_size.size()) + " outputs, native.json names " +
                       std::to_string(art_.graph(graph).outputs.size()) + "; convert the current .onnx again");
    return models_[graph] = m;
  }

  const Artifacts& art_;
  fs::path om_dir_;
  int device_;
  aclrtContext context_ = nullptr;
  std::map<std::string, Model> models_;
  std::mutex mutex_;
};

}  // namespace

std::unique_ptr<Executor> acl_executor(const Artifacts& art, const fs::path& om_dir, int device) {
  return std::make_unique<AclExecutor>(art, om_dir, device);
}

}  // namespace specair
