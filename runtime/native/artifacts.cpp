// The artifact directory: manifest.json and native.json checked, weights.safetensors mapped, and the
// AOTInductor executor that loads each package on its first call and hands it the shared weights.
#include "runner.h"

#include <ATen/Version.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#ifndef SPECAIR_TORCH_VERSION
#error "SPECAIR_TORCH_VERSION (torch.__version__ of the wheel whose libtorch this links) must be defined"
#endif

namespace specair {

namespace {

constexpr int kManifestFormat = 1;  // compile/artifacts.py FORMAT
constexpr int kNativeFormat = 1;    // runtime/native_manifest.py FORMAT

json read_json(const fs::path& path, const std::string& what_if_missing) {
  std::ifstream f(path);
  if (!f) throw InputError(what_if_missing);
  try {
    return json::parse(f);
  } catch (const json::exception& e) {
    throw InputError(path.string() + " is corrupt (" + e.what() + "); recompile with `specair compile`");
  }
}

at::ScalarType scalar_type(const std::string& name) {
  static const std::map<std::string, at::ScalarType> types = {
      {"float32", at::kFloat}, {"float64", at::kDouble}, {"float16", at::kHalf}, {"bfloat16", at::kBFloat16},
      {"int64", at::kLong},    {"int32", at::kInt},      {"bool", at::kBool},    {"uint8", at::kByte},
      {"F32", at::kFloat},     {"F64", at::kDouble},     {"F16", at::kHalf},     {"BF16", at::kBFloat16},
      {"I64", at::kLong},      {"I32", at::kInt},        {"BOOL", at::kBool},    {"U8", at::kByte},
      {"I8", at::kChar},       {"I16", at::kShort}};
  auto it = types.find(name);
  if (it == types.end()) throw InputError("unsupported tensor type " + name);
  return it->second;
}

std::vector<int64_t> ints(const json& j) { return j.get<std::vector<int64_t>>(); }

std::string short_value(const json& j) {
  std::string s = j.is_string() ? j.get<std::string>() : j.dump();
  return s.size() > 16 ? s.substr(0, 16) + "…" : s;
}

// A read-only mapping of weights.safetensors; tensors alias it (copy-on-write private pages).
struct Mapping {
  void* base = MAP_FAILED;
  size_t size = 0;
  ~Mapping() {
    if (base != MAP_FAILED) munmap(base, size);
  }
};

std::map<std::string, at::Tensor> map_safetensors(const fs::path& path, const std::string& hint) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw InputError("artifacts in " + path.parent_path().string() + " lack " + path.filename().string() +
                               " (the weights the native runner hands its graphs); recompile with: " + hint);
  struct stat st {};
  fstat(fd, &st);
  auto map = std::make_shared<Mapping>();
  map->size = static_cast<size_t>(st.st_size);
  if (map->size >= 8) map->base = mmap(nullptr, map->size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  ::close(fd);
  auto corrupt = [&](const std::string& why) {
    return InputError(path.string() + " is corrupt (" + why + "); recompile with: " + hint);
  };
  if (map->base == MAP_FAILED) throw corrupt("cannot map it");
  const auto* bytes = static_cast<const uint8_t*>(map->base);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (8 + header_len > map->size) throw corrupt("header past the end");
  json header;
  try {
    header = json::parse(bytes + 8, bytes + 8 + header_len);
  } catch (const json::exception& e) {
    throw corrupt(e.what());
  }
  uint8_t* data = static_cast<uint8_t*>(map->base) + 8 + header_len;
  size_t data_len = map->size - 8 - header_len;
  std::map<std::string, at::Tensor> out;
  for (auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    auto offsets = ints(info.at("data_offsets"));
    auto shape = ints(info.at("shape"));
    auto dtype = scalar_type(info.at("dtype").get<std::string>());
    if (offsets.size() != 2 || offsets[0] > offsets[1] || static_cast<size_t>(offsets[1]) > data_len)
      throw corrupt("tensor " + name + " outside the file");
    int64_t numel = 1;
    for (auto d : shape) numel *= d;
    if (numel * static_cast<int64_t>(c10::elementSize(dtype)) != offsets[1] - offsets[0])
      throw corrupt("tensor " + name + " has the wrong size");
    void* ptr = data + offsets[0];
    auto keep = map;
    at::Tensor t = at::from_blob(ptr, shape, [keep](void*) {}, at::TensorOptions().dtype(dtype));
    // Compiled kernels may assume the allocator's alignment; a tensor the file packs off it is copied.
    out[name] = reinterpret_cast<uintptr_t>(ptr) % 64 ? t.clone() : t;
  }
  return out;
}

class AotiExecutor : public Executor {
 public:
  explicit AotiExecutor(const Artifacts& art)
      : art_(art), weights_(map_safetensors(art.dir / "weights.safetensors", art.recompile)) {
    const json aliases = art.native.value("aliases", json::object());
    for (auto& [name, target] : aliases.items())
      aliases_[name] = target.get<std::string>();
    for (const auto& [name, io] : art.graphs)  // loaded on first call, but a missing one fails before any runs
      if (!fs::is_regular_file(art.dir / (name + ".pt2"))) throw missing(name, name + ".pt2 is missing");
  }

  Tensors run(const std::string& graph, Tensors inputs) override {
    return load(graph).boxed_run(std::move(inputs));
  }

 private:
  InputError missing(const std::string& graph, const std::string& why) const {
    return InputError("artifact " + graph + " in " + art_.dir.string() + " cannot be loaded (" + why +
                      "); recompile with: " + art_.recompile);
  }

  torch::inductor::AOTIModelPackageLoader& load(const std::string& graph) {
    auto it = loaded_.find(graph);
    if (it != loaded_.end()) return *it->second;
    fs::path pt2 = art_.dir / (graph + ".pt2");
    auto fail = [&](const std::string& why) { return missing(graph, why); };
    if (!fs::is_regular_file(pt2)) throw fail(pt2.filename().string() + " is missing");
    std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
    try {
      loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(pt2.string(), "model", false, 1, -1);
    } catch (const std::exception& e) {
      throw fail(std::string(e.what()).substr(0, 200));
    }
    std::unordered_map<std::string, at::Tensor> constants;
    for (const auto& fqn : loader->get_constant_fqns()) {
      std::string name = weights_.count(graph + "/" + fqn) ? graph + "/" + fqn : fqn;
      if (aliases_.count(name)) name = aliases_[name];
      auto w = weights_.find(name);
      if (w == weights_.end()) throw fail("weights.safetensors lacks its constant " + fqn);
      constants[fqn] = w->second;
    }
    // User-managed: the package aliases our tensors instead of copying them, so every graph shares them.
    loader->load_constants(constants, false, true, true);
    return *(loaded_[graph] = std::move(loader));
  }

  const Artifacts& art_;
  std::map<std::string, at::Tensor> weights_;
  std::map<std::string, std::string> aliases_;
  std::map<std::string, std::unique_ptr<torch::inductor::AOTIModelPackageLoader>> loaded_;
};

uint8_t hex_digit(char c) { return static_cast<uint8_t>(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10); }

}  // namespace

const InputSpec* GraphIO::input(const std::string& name) const {
  for (const auto& in : inputs)
    if (in.name == name) return &in;
  return nullptr;
}

Artifacts Artifacts::open(const fs::path& dir, const std::string& backend) {
  Artifacts a;
  a.dir = dir;
  std::string d = dir.string();
  a.manifest = read_json(dir / "manifest.json", d + " has no manifest.json: not a (finished) specair artifact "
                                                    "directory; build one with `specair compile --backend " +
                                                    backend + " … --out " + d + "`");
  if (a.manifest.value("format", -1) != kManifestFormat)
    throw InputError((dir / "manifest.json").string() + " has format " + a.manifest.value("format", json()).dump() +
                     "; this specair reads format " + std::to_string(kManifestFormat));
  a.native = read_json(dir / "native.json", d + " has no native.json (the native runner's table, written by "
                                                "`specair compile` since the runner exists); recompile with "
                                                "`specair compile --backend " + backend + " … --out " + d + "`");
  if (a.native.value("format", -1) != kNativeFormat)
    throw InputError((dir / "native.json").string() + " has format " + a.native.value("format", json()).dump() +
                     "; this specair-run reads format " + std::to_string(kNativeFormat));
  try {
    a.recompile = a.native.at("recompile").get<std::string>();
    std::vector<std::string> problems;
    std::string built = a.manifest.at("backend").get<std::string>();
    if (built == "aoti" && a.manifest.value("device", "cpu") != "cpu")
      throw InputError("the artifacts in " + d + " are for device '" + a.manifest.value("device", "") +
                       "'; specair-run runs CPU aoti artifacts (and Ascend .om models with --executor acl)");
    if (built != backend) problems.push_back("they were compiled for backend '" + built + "', not '" + backend + "'");
    const json& versions = a.manifest.at("versions");
    std::string torch = versions.value("torch", "none");
    if (backend == "aoti" && torch != SPECAIR_TORCH_VERSION)  // the packages link this libtorch
      problems.push_back(std::string("torch is ") + SPECAIR_TORCH_VERSION + " but they were built with " + torch);
    if (backend == "aoti" && versions.value("aoti_cpu", "none") != at::get_cpu_capability())
      problems.push_back("aoti_cpu is " + at::get_cpu_capability() + " but they were built with " +
                         versions.value("aoti_cpu", "none"));
    for (auto& [name, value] : a.manifest.at("fingerprints").items())
      if (a.native.at("fingerprints").value(name, json()) != value)
        problems.push_back("the " + name + " differs (artifacts: " + short_value(value) + ", native.json: " +
                           short_value(a.native.at("fingerprints").value(name, json())) + ")");
    if (a.native.at("versions") != versions) problems.push_back("native.json was written by another specair build");
    if (!problems.empty()) {
      std::string msg = "cannot use the artifacts in " + d + ": ";
      for (size_t i = 0; i < problems.size(); ++i) msg += (i ? "; " : "") + problems[i];
      throw InputError(msg + ". Recompile with: " + a.recompile);
    }
    for (auto& [name, io] : a.native.at("graphs").items()) {
      GraphIO g;
      for (const auto& in : io.at("inputs"))
        g.inputs.push_back({in.at("name"), ints(in.at("shape")), scalar_type(in.at("dtype"))});
      g.outputs = io.at("outputs").get<std::vector<std::string>>();
      a.graphs[name] = std::move(g);
    }
    for (const auto& name : a.manifest.at("graphs"))
      if (!a.graphs.count(name.get<std::string>()))
        throw InputError("native.json in " + d + " does not describe graph " + name.get<std::string>() +
                         "; recompile with: " + a.recompile);
    const json& model = a.native.at("model");
    const json& plan = a.native.at("plan");
    a.vocab_size = model.at("vocab_size");
    a.eos = ints(model.at("eos_token_ids"));
    a.dtype = scalar_type(model.at("dtype"));
    a.feature_size = model.at("feature_size");
    a.max_context = plan.at("max_context");
    a.slots = plan.at("slots");
    a.max_depth = plan.at("max_depth");
    a.batch_buckets = ints(plan.at("batch_buckets"));
    a.ctx_buckets = ints(plan.at("ctx_buckets"));
    a.chunk_buckets = ints(plan.at("chunk_buckets"));
    a.depths = ints(plan.at("depths"));
    a.variants = plan.at("variants").get<std::vector<std::string>>();
    a.proposer = a.native.at("proposer");
    for (const auto& hex : a.native.at("vocab").is_null() ? json::array() : a.native.at("vocab")) {
      const std::string& h = hex.get_ref<const std::string&>();
      std::string bytes(h.size() / 2, '\0');
      for (size_t i = 0; i < bytes.size(); ++i)
        bytes[i] = static_cast<char>(hex_digit(h[2 * i]) << 4 | hex_digit(h[2 * i + 1]));
      a.vocab.push_back(std::move(bytes));
    }
  } catch (const json::exception& e) {
    throw InputError((dir / "native.json").string() + " is corrupt (" + e.what() +
                     "); recompile with `specair compile`");
  }
  return a;
}

const GraphIO& Artifacts::graph(const std::string& name) const {
  auto it = graphs.find(name);
  if (it == graphs.end())
    throw InputError("graph " + name + " is not in the compiled plan of " + dir.string() +
                     "; recompile with buckets that cover it: " + recompile);
  return it->second;
}

int64_t Artifacts::context_bucket(int64_t needed) const {
  for (auto c : ctx_buckets)
    if (c >= needed) return c;
  throw InputError(std::to_string(needed) + " tokens of context exceed the plan's max_context " +
                   std::to_string(max_context));
}

int64_t Artifacts::chunk_for(int64_t tokens) const {
  for (auto c : chunk_buckets)
    if (c >= tokens) return c;
  return chunk_buckets.back();
}

std::string Artifacts::variant_for(const std::string& wanted) const {
  static const std::vector<std::string> order = {"greedy", "plain", "filtered"};  // compile/plan.py VARIANTS
  auto it = std::find(order.begin(), order.end(), wanted);
  for (; it != order.end(); ++it)
    if (std::find(variants.begin(), variants.end(), *it) != variants.end()) return *it;
  std::string have;
  for (const auto& v : variants) have += (have.empty() ? "" : ", ") + v;
  throw InputError("sampling variant '" + wanted + "' is not in the plan (" + have +
                   "); recompile with --variants including it");
}

const json& Artifacts::step(int64_t batch, int64_t ctx, const std::string& variant, std::optional<int> shape) const {
  for (const auto& s : native.at("steps"))
    if (s.at("batch") == batch && s.at("ctx") == ctx && s.at("variant") == variant &&
        (shape ? s.at("shape") == *shape : s.at("shape").is_null()))
      return s;
  throw InputError("no compiled step for batch " + std::to_string(batch) + ", context " + std::to_string(ctx) +
                   ", variant " + variant + " in " + dir.string() + "; recompile with: " + recompile);
}

const json& Artifacts::prefill(int64_t ctx, int64_t chunk) const {
  for (const auto& p : native.at("prefill"))
    if (p.at("ctx") == ctx && p.at("chunk") == chunk) return p;
  throw InputError("no prefill graph for context " + std::to_string(ctx) + ", chunk " + std::to_string(chunk));
}

const std::string& Artifacts::token_bytes(int64_t id) const {
  static const std::string none;
  return id >= 0 && id < static_cast<int64_t>(vocab.size()) ? vocab[id] : none;
}

std::unique_ptr<Executor> aoti_executor(const Artifacts& art) { return std::make_unique<AotiExecutor>(art); }

// Python's bytes.decode("utf-8", "replace") (and Rust's from_utf8_lossy, which HF tokenizers use): each
// maximal ill-formed subpart becomes one U+FFFD.
std::string utf8_lossy(const std::string& s) {
  static const std::string fffd = "\xEF\xBF\xBD";
  std::string out;
  size_t i = 0, n = s.size();
  auto byte = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  while (i < n) {
    uint8_t c = byte(i);
    if (c < 0x80) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    int len = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (!len) {
      out += fffd;
      ++i;
      continue;
    }
    size_t k = 1;
    for (; k < static_cast<size_t>(len) && i + k < n; ++k) {
      uint8_t b = byte(i + k);
      uint8_t lo = 0x80, hi = 0xBF;
      if (k == 1) {
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
      }
      if (b < lo || b > hi) break;
    }
    if (k == static_cast<size_t>(len)) {
      out.append(s, i, len);
    } else {
      out += fffd;
    }
    i += k;
  }
  return out;
}

}  // namespace specair
