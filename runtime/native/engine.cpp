// The step loop of runtime/engine.py for one sequence, in the smallest batch bucket (padding rows compute on
// zeros, as in Python), with the proposers' protocols of runtime/proposers/: the n-gram index, a draft with
// its own cache (draft model, layer skip, EAGLE, EAGLE-3) and heads on the last hidden state (Medusa,
// MLPSpeculator). Random draws come from the request's own generator in Python's order, so a seeded
// sampled run gives the Python engine's tokens.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/DistributionsHelper.h>

#include <chrono>
#include <limits>
#include <random>
#include <sstream>
#include <unordered_map>

#include "runner.h"

namespace specair {

namespace {

using Clock = std::chrono::steady_clock;
double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// graphs/sampling.py, op for op (the same ATen kernels, so the same bits).
at::Tensor logits_to_probs(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                           const at::Tensor& top_p, bool filtered) {
  int64_t V = logits.size(-1);
  std::vector<int64_t> view(logits.dim(), 1);
  view[0] = -1;
  at::Tensor t = temperature.clamp_min(1e-5).view(view);
  bool half = logits.scalar_type() == at::kHalf || logits.scalar_type() == at::kBFloat16;
  at::Tensor x = half ? (logits / t).to(at::kFloat) : logits / t;
  if (!filtered) return x.softmax(-1);
  at::Tensor k = at::where(top_k > 0, top_k, at::full_like(top_k, V)).view(view);
  at::Tensor p_max = top_p.view(view).to(x.scalar_type());
  auto [sorted_x, order] = x.sort(-1, true);
  at::Tensor ranks = at::arange(V, at::TensorOptions().dtype(at::kLong).device(logits.device()));
  sorted_x = sorted_x.masked_fill(ranks >= k, -std::numeric_limits<double>::infinity());
  at::Tensor p = sorted_x.softmax(-1);
  at::Tensor keep = (p.cumsum(-1) - p) < p_max;
  p = sorted_x.masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity()).softmax(-1);
  return at::zeros_like(p).scatter(-1, order, p);
}

at::Tensor sample(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                  const at::Tensor& top_p, const at::Tensor& uniform, const std::string& variant) {
  at::Tensor greedy = logits.argmax(-1);
  if (variant == "greedy") return greedy;
  at::Tensor probs = logits_to_probs(logits, temperature, top_k, top_p, variant == "filtered");
  at::Tensor cdf = probs.cumsum(-1);
  at::Tensor u = uniform.unsqueeze(-1).to(cdf.scalar_type()) * cdf.slice(-1, cdf.size(-1) - 1);
  at::Tensor drawn = (cdf <= u).sum(-1).clamp_max(probs.size(-1) - 1);
  return at::where(temperature > 0, drawn, greedy);
}

// graphs/sampling.py sampling_variant for one request.
std::string variant_of(const Params& p) {
  if (p.temperature == 0) return "greedy";
  if (p.top_k <= 0 && p.top_p >= 1) return "plain";
  return "filtered";
}

// graphs/kv.py commit_kv: new [L, B, Hkv, T, D] into caches [L, B, Hkv, S, D] at slots [B, T].
void commit(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& new_k, const at::Tensor& new_v,
            const at::Tensor& slots) {
  int64_t B = slots.size(0), T = slots.size(1);
  at::Tensor rows = at::arange(B, slots.options()).view({B, 1}).expand({B, T});
  k_cache.permute({1, 3, 0, 2, 4}).index_put_({rows, slots}, new_k.permute({1, 3, 0, 2, 4}));
  v_cache.permute({1, 3, 0, 2, 4}).index_put_({rows, slots}, new_v.permute({1, 3, 0, 2, 4}));
}

// runtime/proposers/ngram.py NgramIndex.
struct NgramIndex {
  struct Hash {
    size_t operator()(const std::vector<int64_t>& v) const {
      size_t h = v.size();
      for (auto x : v) h ^= std::hash<int64_t>()(x) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
      return h;
    }
  };
  int64_t min_n = 1, max_n = 1;
  std::vector<int64_t> tokens;
  std::map<int64_t, std::unordered_map<std::vector<int64_t>, size_t, Hash>> tables;

  void extend(const std::vector<int64_t>& seq) {
    for (size_t i = tokens.size(); i < seq.size(); ++i) {
      size_t end = tokens.size();
      for (int64_t n = min_n; n <= max_n; ++n)
        if (end >= static_cast<size_t>(n))
          tables[n][std::vector<int64_t>(tokens.end() - n, tokens.end())] = end;
      tokens.push_back(seq[i]);
    }
  }

  std::vector<int64_t> propose(int64_t k) const {
    for (int64_t n = max_n; n >= min_n; --n) {
      if (tokens.size() < static_cast<size_t>(n)) continue;
      auto t = tables.find(n);
      if (t == tables.end()) continue;
      auto hit = t->second.find(std::vector<int64_t>(tokens.end() - n, tokens.end()));
      if (hit != t->second.end()) {
        size_t end = std::min(tokens.size(), hit->second + static_cast<size_t>(k));
        return std::vector<int64_t>(tokens.begin() + hit->second, tokens.begin() + end);
      }
    }
    return {};
  }
};

// runtime/adaptive.py AdaptiveSpeculation; arm -1 is a plain decode step.
struct Adaptive {
  std::vector<int> arms;
  std::map<int, std::optional<double>> rate;
  double alpha = 0.25;
  int probe = 16, since_probe = 0, probes = 0;

  int choose() {
    for (int a : arms)
      if (!rate[a]) return a;
    int best = arms[0];
    for (int a : arms)
      if (*rate[a] > *rate[best]) best = a;
    if (++since_probe >= probe) {
      since_probe = 0;
      std::vector<int> others;
      for (int a : arms)
        if (a != best) others.push_back(a);
      return others[probes++ % others.size()];
    }
    return best;
  }

  void record(int arm, int64_t tokens, double secs) {
    double r = tokens / std::max(secs, 1e-9);
    rate[arm] = rate[arm] ? (1 - alpha) * *rate[arm] + alpha * r : r;
  }
};

struct Proposal {
  at::Tensor tokens, draft_probs, parents;
};

}  // namespace

struct Runner::Impl {
  const Artifacts& art;
  Executor& exec;
  int64_t B;  // the batch bucket: the smallest (one sequence runs at a time)
  std::string native;  // the proposer's protocol, "" without speculation
  int64_t offset = 0;
  bool reads_hidden = false;
  at::ScalarType udtype;
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> caches, scratch;  // by role
  std::optional<Adaptive> adaptive;

  // The sequence being generated.
  std::vector<int64_t> prompt, seq, out;
  Params params;
  std::string variant;  // the compiled variant its steps run
  at::Generator gen;
  int64_t budget = 0;
  at::Tensor temperature, top_k, top_p;  // [B], padding rows: 0, 0, 1
  at::Tensor last_tokens, positions;     // [B]
  NgramIndex ngram;
  std::vector<int64_t> proposal;
  int64_t draft_length = 0;
  at::Tensor hidden;  // cached draft: pending target states [P, F]; heads: the last state [F]
  SpecStats stats;
  std::string finish;

  Impl(const Artifacts& a, Executor& e) : art(a), exec(e), B(a.batch_buckets.front()) {
    udtype = art.dtype == at::kDouble ? at::kDouble : at::kFloat;  // compile/catalog.py uniform_dtype
    const json& cfg = art.native.at("caches");
    for (auto& [role, c] : cfg.items()) {
      std::vector<int64_t> shape = {c.at("layers"), B, c.at("kv_heads"), art.slots, c.at("head_dim")};
      auto opts = at::TensorOptions().dtype(art.dtype);
      caches[role] = {at::zeros(shape, opts), at::zeros(shape, opts)};
      shape[1] = 1;
      // One row: prompts prefill straight into it; otherwise into a scratch row that is copied in.
      scratch[role] = B == 1 ? caches[role] : std::make_pair(at::zeros(shape, opts), at::zeros(shape, opts));
    }
    if (!art.proposer.is_null()) {
      native = art.proposer.at("native");
      if (native != "ngram" && native != "cached_draft" && native != "last_hidden")
        throw InputError("this specair-run cannot drive proposer protocol '" + native + "'");
      offset = art.proposer.value("offset", 0);
      reads_hidden = art.proposer.value("reads_hidden", false);
      auto count = [&](const char* key) {  // null for proposers other than n-gram
        const json v = art.proposer.value(key, json());
        return v.is_number_integer() ? v.get<int64_t>() : int64_t{1};
      };
      ngram.min_n = count("prompt_lookup_min");
      ngram.max_n = count("prompt_lookup_max");
      if (art.proposer.value("adaptive", false)) {
        adaptive.emplace();
        for (int i = 0; i < static_cast<int>(art.depths.size()); ++i) adaptive->arms.push_back(i);
        adaptive->arms.push_back(-1);
        for (int a : adaptive->arms) adaptive->rate[a] = std::nullopt;
      }
    }
  }

  // ---- graphs by name ---------------------------------------------------------------------------------

  Named call(const std::string& name, const Named& inputs) {
    const GraphIO& io = art.graph(name);
    Tensors in;
    for (const auto& spec : io.inputs) {
      auto it = inputs.find(spec.name);
      if (it == inputs.end()) throw std::runtime_error("graph " + name + " needs input " + spec.name);
      const at::Tensor& t = it->second;
      if (t.sizes() != at::IntArrayRef(spec.shape) || t.scalar_type() != spec.dtype) {
        std::ostringstream msg;
        msg << "graph " << name << ": input " << spec.name << " is " << t.sizes() << " " << t.scalar_type()
            << ", compiled for " << at::IntArrayRef(spec.shape) << " " << spec.dtype << " (static shapes)";
        throw std::runtime_error(msg.str());
      }
      in.push_back(t.is_contiguous() ? t : t.contiguous());
    }
    Tensors outs = exec.run(name, std::move(in));
    Named named;
    for (size_t i = 0; i < io.outputs.size() && i < outs.size(); ++i) named[io.outputs[i]] = outs[i];
    return named;
  }

  static bool takes(const GraphIO& io, const std::string& input) { return io.input(input) != nullptr; }

  // [B, *shape] uniforms: row 0 from the request's generator (drawn as Python's torch.rand(1, *shape)),
  // padding rows zero.
  at::Tensor uniforms(std::vector<int64_t> shape) {
    std::vector<int64_t> one = {1};
    one.insert(one.end(), shape.begin(), shape.end());
    at::Tensor u = at::rand(one, gen, at::TensorOptions().dtype(udtype));
    shape.insert(shape.begin(), B);
    at::Tensor all = at::zeros(shape, at::TensorOptions().dtype(udtype));
    all[0].copy_(u[0]);
    return all;
  }

  Named sampling() { return {{"temperature", temperature}, {"top_k", top_k}, {"top_p", top_p}}; }

  at::Tensor longs(std::vector<int64_t> v) { return at::tensor(v, at::TensorOptions().dtype(at::kLong)); }

  // [B] with row 0 = x and padding rows `pad`.
  at::Tensor row0(int64_t x, int64_t pad = 0) {
    std::vector<int64_t> v(B, pad);
    v[0] = x;
    return longs(v);
  }

  Named kv(const std::string& role, bool from_scratch = false) {
    auto& c = from_scratch ? scratch.at(role) : caches.at(role);
    return {{"k_cache", c.first}, {"v_cache", c.second}};
  }

  void commit_role(const std::string& role, const Named& o, const std::string& k, const std::string& v,
                   const at::Tensor& slots, bool from_scratch = false) {
    auto& c = from_scratch ? scratch.at(role) : caches.at(role);
    commit(c.first, c.second, o.at(k), o.at(v), slots);
  }

  at::Tensor slot_range(const at::Tensor& start, int64_t n) {
    return start.unsqueeze(1) + at::arange(n, at::TensorOptions().dtype(at::kLong));
  }

  int64_t committed() const { return static_cast<int64_t>(seq.size()) - 1; }

  // ---- output (runtime/output.py) ----------------------------------------------------------------------

  std::vector<int64_t> emit(const std::vector<int64_t>& fresh, const std::function<void(const std::string&)>& cb) {
    std::vector<int64_t> taken;
    for (int64_t tok : fresh) {
      out.push_back(tok);
      taken.push_back(tok);
      if (cb) cb(art.token_bytes(tok));
      bool eos = std::find(art.eos.begin(), art.eos.end(), tok) != art.eos.end();
      if (eos && !params.ignore_eos) {
        finish = "stop";
        break;
      }
      if (static_cast<int64_t>(out.size()) >= budget) {
        finish = "length";
        break;
      }
    }
    seq.insert(seq.end(), taken.begin(), taken.end());
    return taken;
  }

  // ---- prefill (Engine._prefill_chunk) -----------------------------------------------------------------

  int64_t prefill(const std::function<void(const std::string&)>& cb) {
    int64_t start = 0, P = static_cast<int64_t>(prompt.size());
    Named o;
    int64_t n = 0;
    while (start < P) {
      int64_t chunk = art.chunk_for(P - start);
      n = std::min(chunk, P - start);
      std::vector<int64_t> tok(chunk, 0);
      std::copy(prompt.begin() + start, prompt.begin() + start + n, tok.begin());
      at::Tensor tokens = longs(tok).view({1, chunk});
      int64_t ctx = art.context_bucket(std::max<int64_t>(start, 1));
      const json& graphs = art.prefill(ctx, chunk);
      at::Tensor cache_len = longs({start});
      Named in = kv("target", true);
      in["tokens"] = tokens;
      in["cache_len"] = cache_len;
      in["n_valid"] = longs({n});
      o = call(graphs.at("target"), in);
      commit_role("target", o, "new_k", "new_v", slot_range(cache_len, chunk), true);
      if (native == "cached_draft") draft_prefill_chunk(graphs.at("draft"), tokens, start, n, o.at("hidden"));
      start += n;
    }
    at::Tensor first_logits = o.at("logits");
    auto opts = at::TensorOptions().dtype(art.dtype);
    at::Tensor u = at::rand({1}, gen, at::TensorOptions().dtype(udtype));
    int64_t first = sample(first_logits, at::full({1}, params.temperature, opts), longs({params.top_k}),
                           at::full({1}, params.top_p, opts), u, variant_of(params))
                        .item<int64_t>();
    seq = prompt;
    at::Tensor last_hidden = o.at("hidden")[0][n - 1];
    if (native == "cached_draft") {
      draft_length = P - offset;
      if (reads_hidden) hidden = last_hidden.unsqueeze(0);
    } else if (native == "last_hidden") {
      hidden = last_hidden;
    } else if (native == "ngram") {
      ngram = NgramIndex{ngram.min_n, ngram.max_n, {}, {}};
    }
    emit({first}, cb);
    return first;
  }

  void draft_prefill_chunk(const std::string& name, at::Tensor tokens, int64_t start, int64_t n,
                           const at::Tensor& target_hidden) {
    int64_t chunk = tokens.size(1), P = static_cast<int64_t>(prompt.size());
    int64_t m = std::min(n, P - offset - start);
    if (m <= 0) return;
    if (offset) {
      std::vector<int64_t> shifted(chunk, 0);
      std::copy(prompt.begin() + start + offset, prompt.begin() + start + offset + m, shifted.begin());
      tokens = longs(shifted).view({1, chunk});
    }
    at::Tensor cache_len = longs({start});
    Named in = kv("draft", true);
    in["tokens"] = tokens;
    in["cache_len"] = cache_len;
    in["n_valid"] = longs({m});
    if (takes(art.graph(name), "input_hidden")) in["input_hidden"] = target_hidden;
    Named o = call(name, in);
    commit_role("draft", o, "new_k", "new_v", slot_range(cache_len, chunk), true);
  }

  void insert_row() {
    for (auto& [role, c] : caches) {
      auto& s = scratch.at(role);
      if (s.first.data_ptr() == c.first.data_ptr()) continue;
      int64_t used = committed();  // KVSlots.insert copies the target's committed length for every role
      c.first.select(1, 0).narrow(2, 0, used).copy_(s.first.select(1, 0).narrow(2, 0, used));
      c.second.select(1, 0).narrow(2, 0, used).copy_(s.second.select(1, 0).narrow(2, 0, used));
    }
    auto opts = at::TensorOptions().dtype(art.dtype);
    temperature = at::zeros({B}, opts);
    temperature[0] = params.temperature;
    top_p = at::ones({B}, opts);
    top_p[0] = params.top_p;
    top_k = row0(params.top_k);
    last_tokens = row0(seq.back());
    positions = row0(committed());
  }

  void advance(const at::Tensor& next_tokens, const at::Tensor& num_new) {
    last_tokens[0] = next_tokens[0];
    positions[0] += num_new[0];
  }

  // ---- decoding (Engine._decode) -----------------------------------------------------------------------

  bool speculates() const {  // Scheduler.speculates for one row
    if (native.empty()) return false;
    const json& dbbs = art.proposer.value("disable_by_batch_size", json());
    if (!dbbs.is_null() && 1 > dbbs.get<int64_t>()) return false;
    if (static_cast<int64_t>(seq.size()) + art.max_depth > art.max_context) return false;
    return budget - static_cast<int64_t>(out.size()) > 1;
  }

  bool can_speculate() {
    if (native != "ngram") return true;
    ngram.extend(seq);
    proposal = ngram.propose(art.max_depth);
    return !proposal.empty();
  }

  std::vector<int64_t> plain_step(int64_t ctx) {
    const json& step = art.step(B, ctx, variant, std::nullopt);
    Named in = kv("target");
    in.merge(sampling());
    in["tokens"] = last_tokens;
    in["cache_len"] = positions;
    in["uniform"] = uniforms({});
    Named o = call(step.at("decode"), in);
    commit_role("target", o, "new_k", "new_v", positions.unsqueeze(1));
    at::Tensor nxt = o.at("next_tokens");
    advance(nxt, longs(std::vector<int64_t>(B, 1)));
    if (native == "cached_draft" && reads_hidden) hidden = at::cat({hidden, o.at("hidden").slice(0, 0, 1)});
    if (native == "last_hidden") hidden = o.at("hidden")[0];
    return {nxt[0].item<int64_t>()};
  }

  std::vector<int64_t> pending() const {
    return std::vector<int64_t>(seq.begin() + std::min<int64_t>(draft_length + offset, seq.size()), seq.end());
  }

  // CachedDraft.sync: bring the draft's cache within one catch-up (D+1 entries) of the sequence.
  void sync(int64_t D) {
    int64_t chunk = art.chunk_buckets.back();
    while (true) {
      int64_t lag = static_cast<int64_t>(pending().size());
      if (lag <= D + 1) return;
      int64_t n = std::min(lag - 1, chunk);
      std::vector<int64_t> tok(B * chunk, 0);
      auto p = pending();
      std::copy(p.begin(), p.begin() + n, tok.begin());
      at::Tensor start = row0(draft_length);
      std::string name = art.step(B, art.context_bucket(std::max<int64_t>(draft_length, 1)), variant, 0).at("sync");
      Named in = kv("draft");
      in["tokens"] = longs(tok).view({B, chunk});
      in["cache_len"] = start;
      in["n_valid"] = row0(n);
      if (reads_hidden) {
        const InputSpec* s = art.graph(name).input("input_hidden");
        at::Tensor h = at::zeros(s->shape, at::TensorOptions().dtype(s->dtype));
        h[0].narrow(0, 0, n).copy_(hidden.narrow(0, 0, n));
        in["input_hidden"] = h;
      }
      Named o = call(name, in);
      commit_role("draft", o, "new_k", "new_v", slot_range(start, chunk));
      draft_length += n;
      if (reads_hidden) hidden = hidden.slice(0, n);
    }
  }

  Proposal propose(const json& step, int64_t D) {
    if (native == "ngram") {
      std::vector<int64_t> tok(B * (D + 1), 0);
      for (int64_t j = 0; j < std::min<int64_t>(proposal.size(), D); ++j) tok[1 + j] = proposal[j];
      at::Tensor tokens = longs(tok).view({B, D + 1});
      tokens.select(1, 0).copy_(last_tokens);
      return {tokens, {}, {}};
    }
    std::string name = step.at("draft");
    const GraphIO& io = art.graph(name);
    Named in;
    if (native == "last_hidden") {
      const InputSpec* s = io.input("hidden");
      at::Tensor h = at::zeros(s->shape, at::TensorOptions().dtype(s->dtype));
      h[0].copy_(hidden);
      in["hidden"] = h;
      in["root"] = last_tokens;
      if (takes(io, "temperature")) in.merge(sampling());
      if (takes(io, "uniforms")) in["uniforms"] = uniforms({D});
      Named o = call(name, in);
      return {o.at("tree_tokens"), o.count("draft_probs") ? o.at("draft_probs") : at::Tensor(), {}};
    }
    sync(D);
    auto p = pending();
    std::vector<int64_t> catch_tokens(B * (D + 1), 0);
    std::copy(p.begin(), p.end(), catch_tokens.begin());
    std::vector<int64_t> n_catch(B, 1);
    n_catch[0] = static_cast<int64_t>(p.size());
    at::Tensor draft_len = row0(draft_length);
    in = kv("draft");
    in["catch_tokens"] = longs(catch_tokens).view({B, D + 1});
    in["n_catch"] = longs(n_catch);
    in["draft_len"] = draft_len;
    if (takes(io, "temperature")) in.merge(sampling());
    if (takes(io, "uniforms")) in["uniforms"] = uniforms({D});
    if (reads_hidden) {
      const InputSpec* s = io.input("catch_hidden");
      at::Tensor h = at::zeros(s->shape, at::TensorOptions().dtype(s->dtype));
      h[0].narrow(0, 0, hidden.size(0)).copy_(hidden);
      in["catch_hidden"] = h;
    }
    Named o = call(name, in);
    commit_role("draft", o, "catch_k", "catch_v", slot_range(draft_len, D + 1));
    draft_length += static_cast<int64_t>(p.size());
    return {o.at("tree_tokens"), o.count("draft_probs") ? o.at("draft_probs") : at::Tensor(),
            o.count("parents") ? o.at("parents") : at::Tensor()};
  }

  std::vector<int64_t> speculative_step(int64_t ctx, int shape) {
    int64_t D = art.depths.at(shape);
    const json& step = art.step(B, ctx, variant, shape);
    at::Tensor root_pos = positions.clone();
    Proposal prop = propose(step, D);
    std::string name = step.at("verify");
    const GraphIO& io = art.graph(name);
    Named in = kv("target");
    in["tree_tokens"] = prop.tokens;
    in["root_pos"] = root_pos;
    if (takes(io, "parents")) in["parents"] = prop.parents;
    if (takes(io, "draft_probs")) in["draft_probs"] = prop.draft_probs;
    if (takes(io, "uniforms")) in["uniforms"] = uniforms({io.input("tree_tokens")->shape[1] + 1});
    if (takes(io, "temperature")) in.merge(sampling());
    Named o = call(name, in);
    commit_role("target", o, "path_k", "path_v", slot_range(root_pos, D + 1));
    at::Tensor n_acc = o.at("num_accepted"), tokens = o.at("tokens");
    advance(tokens.gather(1, n_acc.unsqueeze(1)).squeeze(1), n_acc + 1);
    std::vector<int64_t> toks;
    for (int64_t j = 0; j < tokens.size(1); ++j) {
      int64_t t = tokens[0][j].item<int64_t>();
      if (t >= 0) toks.push_back(t);
    }
    int64_t accepted = static_cast<int64_t>(toks.size()) - 1;
    stats.drafts += 1;
    stats.draft_tokens += D;
    stats.accepted += accepted;
    for (int64_t j = 0; j < accepted; ++j) stats.per_position[j] += 1;
    at::Tensor path_hidden = o.at("path_hidden");
    if (native == "cached_draft" && reads_hidden) hidden = path_hidden[0].slice(0, 0, accepted + 1);
    if (native == "last_hidden") hidden = path_hidden[0][accepted];
    return toks;
  }

  std::vector<int64_t> decode_step() {
    int64_t ctx = art.context_bucket(std::max<int64_t>(committed(), 1));
    bool speculate = speculates() && can_speculate();
    int shape = speculate ? 0 : -1;
    bool choose = speculate && adaptive && variant == "greedy";
    if (choose) shape = adaptive->choose();
    auto t0 = Clock::now();
    std::vector<int64_t> toks = shape < 0 ? plain_step(ctx) : speculative_step(ctx, shape);
    if (choose) adaptive->record(shape, static_cast<int64_t>(toks.size()), seconds(t0, Clock::now()));
    return toks;
  }
};

Runner::Runner(const Artifacts& art, Executor& exec) : impl_(std::make_unique<Impl>(art, exec)) {}
Runner::~Runner() = default;

void Runner::check(const std::vector<int64_t>& prompt, const Params& p) const {
  const Artifacts& art = impl_->art;
  if (prompt.empty()) throw InputError("the prompt is empty");
  for (auto t : prompt)
    if (t < 0 || t >= art.vocab_size)
      throw InputError("token ids must be integers in [0, " + std::to_string(art.vocab_size) + "); got " +
                       std::to_string(t));
  if (static_cast<int64_t>(prompt.size()) >= art.max_context)
    throw InputError("the prompt has " + std::to_string(prompt.size()) + " tokens but the context holds " +
                     std::to_string(art.max_context) + " (prompt plus at least one generated token)");
  if (p.max_tokens < 1) throw InputError("max_tokens must be a positive integer");
  if (!(p.temperature >= 0)) throw InputError("temperature must be a finite number >= 0");
  if (!(p.top_p > 0 && p.top_p <= 1)) throw InputError("top_p must be in (0, 1]");
  if (p.top_k < 0) throw InputError("top_k must be an integer >= 0 (0 disables it)");
  art.variant_for(variant_of(p));
  if (!art.proposer.is_null() && art.proposer.value("acceptance", "") == "greedy" && p.temperature != 0)
    throw InputError("this engine's acceptance is 'greedy', which needs temperature 0; use acceptance "
                     "'rejection' to sample exactly");
}

Result Runner::generate(const std::vector<int64_t>& prompt, const Params& params,
                        const std::function<void(const std::string&)>& on_bytes) {
  check(prompt, params);
  Impl& s = *impl_;
  auto t0 = Clock::now();
  s.prompt = prompt;
  s.params = params;
  s.out.clear();
  s.finish.clear();
  s.variant = s.art.variant_for(variant_of(params));
  s.budget = std::min(params.max_tokens, s.art.max_context - static_cast<int64_t>(prompt.size()));
  uint64_t seed = params.seed ? *params.seed : c10::detail::getNonDeterministicRandom();
  s.gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  s.stats = SpecStats{0, 0, 0, std::vector<int64_t>(s.art.max_depth, 0)};
  s.prefill(on_bytes);
  auto t_first = Clock::now();
  if (s.finish.empty()) s.insert_row();
  while (s.finish.empty()) s.emit(s.decode_step(), on_bytes);
  auto t_end = Clock::now();

  Result r;
  r.token_ids = s.out;
  std::string bytes;
  for (auto t : s.out) bytes += s.art.token_bytes(t);
  r.text = utf8_lossy(bytes);
  r.finish_reason = s.finish;
  r.num_prompt_tokens = static_cast<int64_t>(prompt.size());
  r.ttft_s = seconds(t0, t_first);
  int64_t n = static_cast<int64_t>(s.out.size());
  double dt = seconds(t_first, t_end);
  r.decode_tokens_per_s = n > 1 && dt > 0 ? (n - 1) / dt : 0.0;
  r.prefill_tokens_per_s = r.ttft_s > 0 ? prompt.size() / r.ttft_s : 0.0;
  if (!s.native.empty()) r.spec = s.stats;
  return r;
}

}  // namespace specair
