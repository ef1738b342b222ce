// specair-run: the Python engine's step loop over ahead-of-time compiled graphs, with no Python.
//
// Everything the loop needs to know about the graphs comes from the artifact directory's native.json
// (written by `specair compile`): named inputs with their static shapes, named outputs, which graph runs
// which step, the proposer's protocol. Graphs are called through an Executor: AOTInductor packages here,
// AscendCL `.om` models on Atlas boards.
#pragma once

#include <ATen/ATen.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace specair {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Tensors = std::vector<at::Tensor>;
using Named = std::map<std::string, at::Tensor>;

// Bad input or unusable artifacts: one line on stderr, exit code 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct InputSpec {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype;
};

struct GraphIO {
  std::vector<InputSpec> inputs;
  std::vector<std::string> outputs;
  const InputSpec* input(const std::string& name) const;
};

// Runs compiled graphs by name: inputs in the graph's input order, outputs in its output order.
class Executor {
 public:
  virtual ~Executor() = default;
  virtual Tensors run(const std::string& graph, Tensors inputs) = 0;
};

struct Artifacts {
  fs::path dir;
  json manifest, native;
  std::map<std::string, GraphIO> graphs;
  std::string recompile;  // the `specair compile` command that rebuilds them

  // The plan, as native.json states it.
  int64_t vocab_size = 0, max_context = 0, slots = 0, max_depth = 0, feature_size = 0;
  std::vector<int64_t> batch_buckets, ctx_buckets, chunk_buckets, depths, eos;
  std::vector<std::string> variants;
  at::ScalarType dtype = at::kFloat;
  json proposer;  // null without speculation

  // Checks the manifest and native.json (format, backend, versions of this build, that they belong
  // together) and raises InputError with the same wording as the Python loader.
  static Artifacts open(const fs::path& dir, const std::string& backend);
  const GraphIO& graph(const std::string& name) const;
  int64_t context_bucket(int64_t needed) const;
  int64_t chunk_for(int64_t tokens) const;
  std::string variant_for(const std::string& wanted) const;
  const json& step(int64_t batch, int64_t ctx, const std::string& variant, std::optional<int> shape) const;
  const json& prefill(int64_t ctx, int64_t chunk) const;
  std::vector<std::string> vocab;  // each token's bytes ("" for special tokens)
  const std::string& token_bytes(int64_t id) const;
};

std::unique_ptr<Executor> aoti_executor(const Artifacts& art);
#ifdef SPECAIR_WITH_ACL
std::unique_ptr<Executor> acl_executor(const Artifacts& art, const fs::path& om_dir, int device);
#endif

struct Params {
  int64_t max_tokens = 256;
  double temperature = 0.0, top_p = 1.0;
  int64_t top_k = 0;
  std::optional<uint64_t> seed;
  bool ignore_eos = false;
};

struct SpecStats {
  int64_t drafts = 0, draft_tokens = 0, accepted = 0;
  std::vector<int64_t> per_position;
};

struct Result {
  std::vector<int64_t> token_ids;
  std::string text;  // UTF-8, invalid sequences replaced by U+FFFD
  std::string finish_reason;
  int64_t num_prompt_tokens = 0;
  double ttft_s = 0, decode_tokens_per_s = 0, prefill_tokens_per_s = 0;
  std::optional<SpecStats> spec;
};

// The Python engine's loop (runtime/engine.py): continuous batching of up to `max_num_seqs` sequences over
// the plan's batch buckets; each step a decode or speculative step over the running rows (propose →
// verify-and-accept → commit), then one prefill chunk of the next prompt.
class Runner {
 public:
  Runner(const Artifacts& art, Executor& exec, int64_t max_num_seqs = 1);
  ~Runner();
  // Raises InputError for a prompt the artifacts cannot take (checked before anything runs).
  void check(const std::vector<int64_t>& prompt, const Params& params) const;
  // Every prompt to its end; results in prompt order. on_bytes(i, bytes) streams prompt i's text as its
  // tokens come, on_result(i, result) reports it when it finishes.
  std::vector<Result> generate(const std::vector<std::vector<int64_t>>& prompts, const Params& params,
                               const std::function<void(size_t, const std::string&)>& on_bytes = nullptr,
                               const std::function<void(size_t, const Result&)>& on_result = nullptr);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

std::string utf8_lossy(const std::string& bytes);

}  // namespace specair
