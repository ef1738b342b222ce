// The step loop of runtime/engine.py: rows, batch buckets (padding rows compute on zeros), one prefill chunk
// per step, with the proposers' protocols of runtime/proposers/: the n-gram index, a draft with its own
// cache (draft model, layer skip, EAGLE, EAGLE-3) and heads on the last hidden state (Medusa,
// MLPSpeculator). The uniform that decides a token is a function of the request's seed and the token's
// position (graphs/sampling.py position_uniforms), so a seeded sampled run gives the Python engine's tokens.
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <random>
#include <sstream>
#include <unordered_map>

#include <sys/mman.h>
#include <unistd.h>

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

// models/memory.py zeros: an anonymous mapping, whose pages are committed on first write, so a cache of the
// full context holds memory only for the slots written to it.
at::Tensor on_demand_zeros(at::IntArrayRef shape, at::ScalarType dtype) {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  size_t bytes = static_cast<size_t>(c10::multiply_integers(shape)) * c10::elementSize(dtype);
  if (bytes < page) return at::zeros(shape, at::TensorOptions().dtype(dtype));
  size_t span = (bytes + page - 1) / page * page;
  void* base = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED)
    throw std::runtime_error("cannot map " + std::to_string(span) + " bytes for a KV cache");
#ifdef MADV_NOHUGEPAGE
  madvise(base, span, MADV_NOHUGEPAGE);  // one huge page would cover a whole layer's slots of a row
#endif
  return at::from_blob(base, shape, [span](void* p) { munmap(p, span); }, at::TensorOptions().dtype(dtype));
}

// models/memory.py release: row `row`'s whole pages from slot `start` on, in a cache [L, B, Hkv, S, D] made
// by on_demand_zeros, hold no memory and read as zeros again.
void release(const at::Tensor& cache, int64_t row, int64_t start = 0) {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (cache.nbytes() < page || start >= cache.size(3)) return;
  int64_t L = cache.size(0), B = cache.size(1), H = cache.size(2);
  uintptr_t slot = cache.size(4) * cache.element_size(), run = cache.size(3) * slot, skip = start * slot;
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (int64_t l = 0; l < L; ++l)
    for (int64_t h = 0; h < H; ++h) {
      uintptr_t lo = reinterpret_cast<uintptr_t>(cache.data_ptr()) + ((l * B + row) * H + h) * run;
      if (!spans.empty() && spans.back().second == lo + skip) spans.back().second = lo + run;
      else spans.emplace_back(lo + skip, lo + run);
    }
  for (auto [lo, hi] : spans) {
    uintptr_t first = (lo + page - 1) / page * page, end = hi / page * page;
    if (end > first && madvise(reinterpret_cast<void*>(first), end - first, MADV_DONTNEED) != 0)
      throw std::runtime_error("madvise(MADV_DONTNEED) failed on a KV cache");
  }
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
  at::Tensor tokens, parents;
};

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// graphs/sampling.py position_uniforms: SplitMix64 keyed by the mixed seed, read at the position; 24 random
// bits for float32 and 53 for float64, so the value is exact and below 1.
double position_uniform(uint64_t seed, int64_t position, bool dbl) {
  uint64_t z = mix64(mix64(seed) + static_cast<uint64_t>(position) * 0x9E3779B97F4A7C15ull);
  int bits = dbl ? 53 : 24;
  return static_cast<double>(z >> (64 - bits)) * std::ldexp(1.0, -bits);
}

}  // namespace

// One request (runtime/scheduler.py Seq, with the proposer's per-sequence state beside it).
struct Seq {
  size_t index = 0;  // its line in the prompts file
  std::vector<int64_t> prompt, seq, out;  // seq: prompt + generated; its last token is not in the cache yet
  std::string variant;  // its own sampling variant
  uint64_t seed = 0;
  int64_t budget = 0, prefilled = 0;
  NgramIndex ngram;
  std::vector<int64_t> proposal;
  int64_t draft_length = 0;  // entries in the draft's cache
  at::Tensor hidden;  // cached draft: target states of pending entries [P, F]; heads: the last state [F]
  SpecStats stats;
  std::string finish;
  Clock::time_point t0, t_first;
  int64_t committed() const { return static_cast<int64_t>(seq.size()) - 1; }
};

struct Runner::Impl {
  const Artifacts& art;
  Executor& exec;
  int64_t num_slots, B = 0;  // B: the current batch bucket
  std::string native;  // the proposer's protocol, "" without speculation
  int64_t offset = 0;
  bool reads_hidden = false, alias_scratch;
  at::ScalarType udtype;
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> caches, scratch;  // by role
  std::map<std::string, json> cache_shape;
  std::optional<Adaptive> adaptive;
  Params params;
  at::Tensor temperature, top_k, top_p, last_tokens, positions, active;  // per slot (runtime/batch_state.py)
  std::vector<Seq*> rows;
  std::deque<Seq*> waiting;
  Seq* prefilling = nullptr;
  std::function<void(size_t, const std::string&)> on_bytes;
  std::function<void(Seq&)> on_finish;

  Impl(const Artifacts& a, Executor& e, int64_t max_num_seqs) : art(a), exec(e) {
    num_slots = std::min(max_num_seqs, art.batch_buckets.back());
    udtype = art.dtype == at::kDouble ? at::kDouble : at::kFloat;  // compile/catalog.py uniform_dtype
    // With one batch bucket of one row, prompts prefill straight into that row; else into a scratch row.
    alias_scratch = art.batch_buckets.back() == 1;
    for (auto& [role, c] : art.native.at("caches").items()) {
      cache_shape[role] = c;
      scratch[role] = {empty_cache(role, 1), empty_cache(role, 1)};
      if (alias_scratch) caches[role] = scratch[role];
    }
    if (alias_scratch) B = 1;
    int64_t slots = art.batch_buckets.back();
    auto opts = at::TensorOptions().dtype(art.dtype);
    temperature = at::zeros({slots}, opts);
    top_p = at::ones({slots}, opts);
    top_k = at::zeros({slots}, at::kLong);
    last_tokens = at::zeros({slots}, at::kLong);
    positions = at::zeros({slots}, at::kLong);
    active = at::zeros({slots}, at::kBool);
    if (!art.proposer.is_null()) {
      native = art.proposer.at("native");
      if (native != "ngram" && native != "cached_draft" && native != "last_hidden")
        throw InputError("this specair-run cannot drive proposer protocol '" + native + "'");
      offset = art.proposer.value("offset", 0);
      reads_hidden = art.proposer.value("reads_hidden", false);
      if (art.proposer.value("adaptive", false)) {
        adaptive.emplace();
        for (int i = 0; i < static_cast<int>(art.depths.size()); ++i) adaptive->arms.push_back(i);
        adaptive->arms.push_back(-1);
        for (int arm : adaptive->arms) adaptive->rate[arm] = std::nullopt;
      }
    }
  }

  at::Tensor empty_cache(const std::string& role, int64_t rows_) {
    const json& c = cache_shape.at(role);
    return on_demand_zeros({c.at("layers").get<int64_t>(), rows_, c.at("kv_heads").get<int64_t>(), art.slots,
                            c.at("head_dim").get<int64_t>()},
                           art.dtype);
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

  // The uniforms of one sequence's positions from..from+n-1 [n].
  at::Tensor uniforms_at(const Seq& s, int64_t from, int64_t n) const {
    std::vector<double> u(n);
    for (int64_t j = 0; j < n; ++j) u[j] = position_uniform(s.seed, from + j, udtype == at::kDouble);
    return at::tensor(u, at::TensorOptions().dtype(at::kDouble)).to(udtype);
  }

  // The uniforms of each running row's next n positions [B, n] (n = 0: [B]); zeros for greedy rows (argmax
  // reads none) and after the running rows.
  at::Tensor uniforms(int64_t n) const {
    at::Tensor all = at::zeros({B, std::max<int64_t>(n, 1)}, at::TensorOptions().dtype(udtype));
    for (size_t i = 0; i < rows.size(); ++i)
      if (rows[i]->variant != "greedy")
        all[i].copy_(uniforms_at(*rows[i], static_cast<int64_t>(rows[i]->seq.size()), std::max<int64_t>(n, 1)));
    return n ? all : all.select(1, 0);
  }

  Named sampling() {
    return {{"temperature", temperature.slice(0, 0, B)}, {"top_k", top_k.slice(0, 0, B)},
            {"top_p", top_p.slice(0, 0, B)}};
  }

  static at::Tensor longs(const std::vector<int64_t>& v) {
    return at::tensor(v, at::TensorOptions().dtype(at::kLong));
  }

  // [B]: f(row) for the running rows, `pad` after.
  template <typename F>
  at::Tensor per_row(F f, int64_t pad = 0) {
    std::vector<int64_t> v(B, pad);
    for (size_t i = 0; i < rows.size(); ++i) v[i] = f(*rows[i]);
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

  static at::Tensor slot_range(const at::Tensor& start, int64_t n) {
    return start.unsqueeze(1) + at::arange(n, at::TensorOptions().dtype(at::kLong));
  }

  // ---- rows (Engine._insert_row / _remove_row, KVSlots, BatchState) -------------------------------------

  int64_t batch_bucket(int64_t n) const {
    for (auto b : art.batch_buckets)
      if (b >= n) return b;
    return art.batch_buckets.back();
  }

  // dst[:, d, :, :used] = src[:, s, :, :used]: one row's first `used` cache slots.
  static void copy_slots(const at::Tensor& dst, int64_t d, const at::Tensor& src, int64_t s, int64_t used) {
    dst.select(1, d).narrow(2, 0, used).copy_(src.select(1, s).narrow(2, 0, used));
  }

  // Each kept row copies its own used slots only, so no row commits memory for slots it does not use.
  void resize(int64_t n) {
    int64_t nb = batch_bucket(std::max<int64_t>(n, 1));
    if (nb == B) return;
    int64_t keep = std::min({n, nb, B, static_cast<int64_t>(rows.size())});
    for (auto& [role, shape] : cache_shape) {
      std::pair<at::Tensor, at::Tensor> fresh = {empty_cache(role, nb), empty_cache(role, nb)};
      for (int64_t i = 0; B && i < keep; ++i) {
        int64_t used = static_cast<int64_t>(rows[i]->seq.size());
        copy_slots(fresh.first, i, caches[role].first, i, used);
        copy_slots(fresh.second, i, caches[role].second, i, used);
      }
      caches[role] = fresh;
    }
    B = nb;
  }

  void set_row(int64_t i, const Seq& s) {
    last_tokens[i] = s.seq.back();
    positions[i] = s.committed();
    top_k[i] = params.top_k;
    active[i] = true;
    temperature[i] = params.temperature;
    top_p[i] = params.top_p;
  }

  void insert_row(Seq* s) {
    int64_t row = static_cast<int64_t>(rows.size());
    resize(row + 1);
    rows.push_back(s);
    if (!alias_scratch)
      for (auto& [role, c] : caches) {  // KVSlots.insert: the committed length, for every role
        copy_slots(c.first, row, scratch[role].first, 0, s->committed());
        copy_slots(c.second, row, scratch[role].second, 0, s->committed());
        for (const at::Tensor* t : {&c.first, &c.second}) release(*t, row, s->committed());
        release(scratch[role].first, 0);
        release(scratch[role].second, 0);
      }
    set_row(row, *s);
  }

  void remove_row(int64_t i) {
    int64_t last = static_cast<int64_t>(rows.size()) - 1;
    if (i != last) {
      int64_t used = static_cast<int64_t>(rows[last]->seq.size());
      for (auto& [role, c] : caches) {
        copy_slots(c.first, i, c.first, last, used);
        copy_slots(c.second, i, c.second, last, used);
        for (const at::Tensor* t : {&c.first, &c.second}) release(*t, i, used);
      }
      for (at::Tensor* t : {&last_tokens, &positions, &top_k, &active, &temperature, &top_p})
        (*t)[i].copy_((*t)[last]);
      rows[i] = rows[last];
    }
    for (auto& [role, c] : caches)
      for (const at::Tensor* t : {&c.first, &c.second}) release(*t, last);
    rows.pop_back();
    last_tokens[last] = 0;
    positions[last] = 0;
    top_k[last] = 0;
    active[last] = false;
    temperature[last] = 0.0;
    top_p[last] = 1.0;
    if (!rows.empty()) resize(static_cast<int64_t>(rows.size()));
  }

  void advance(const at::Tensor& next_tokens, const at::Tensor& num_new) {
    at::Tensor on = active.slice(0, 0, B);
    last_tokens.slice(0, 0, B).copy_(at::where(on, next_tokens, last_tokens.slice(0, 0, B)));
    positions.slice(0, 0, B).add_(on * num_new);
  }

  // ---- output (runtime/output.py) ----------------------------------------------------------------------

  void emit(Seq& s, const std::vector<int64_t>& fresh) {
    std::vector<int64_t> taken;
    for (int64_t tok : fresh) {
      s.out.push_back(tok);
      taken.push_back(tok);
      if (on_bytes) on_bytes(s.index, art.token_bytes(tok));
      bool eos = std::find(art.eos.begin(), art.eos.end(), tok) != art.eos.end();
      if (eos && !params.ignore_eos) {
        s.finish = "stop";
        break;
      }
      if (static_cast<int64_t>(s.out.size()) >= s.budget) {
        s.finish = "length";
        break;
      }
    }
    s.seq.insert(s.seq.end(), taken.begin(), taken.end());
    if (!s.finish.empty()) on_finish(s);
  }

  // ---- prefill (Engine._prefill_chunk) -----------------------------------------------------------------

  void prefill_chunk(Seq& s) {
    int64_t P = static_cast<int64_t>(s.prompt.size()), start = s.prefilled;
    if (start == 0) {  // Proposer.start
      s.t0 = Clock::now();
      s.ngram = NgramIndex{s.ngram.min_n, s.ngram.max_n, {}, {}};
      s.draft_length = 0;
    }
    int64_t chunk = art.chunk_for(P - start), n = std::min(chunk, P - start);
    std::vector<int64_t> tok(chunk, 0);
    std::copy(s.prompt.begin() + start, s.prompt.begin() + start + n, tok.begin());
    at::Tensor tokens = longs(tok).view({1, chunk});
    int64_t ctx = art.context_bucket(std::max<int64_t>(start, 1));
    const json& graphs = art.prefill(ctx, chunk);
    at::Tensor cache_len = longs({start});
    Named in = kv("target", true);
    in["tokens"] = tokens;
    in["cache_len"] = cache_len;
    in["n_valid"] = longs({n});
    Named o = call(graphs.at("target"), in);
    commit_role("target", o, "new_k", "new_v", slot_range(cache_len, chunk), true);
    if (native == "cached_draft") draft_prefill_chunk(s, graphs.at("draft"), tokens, start, n, o.at("hidden"));
    s.prefilled += n;
    if (s.prefilled < P) return;
    prefilling = nullptr;
    auto opts = at::TensorOptions().dtype(art.dtype);
    at::Tensor u = uniforms_at(s, P, 1);
    int64_t first = sample(o.at("logits"), at::full({1}, params.temperature, opts), longs({params.top_k}),
                           at::full({1}, params.top_p, opts), u, s.variant)
                        .item<int64_t>();
    s.t_first = Clock::now();
    s.seq = s.prompt;
    at::Tensor last_hidden = o.at("hidden")[0][n - 1];
    if (native == "cached_draft") {
      s.draft_length = P - offset;
      if (reads_hidden) s.hidden = last_hidden.unsqueeze(0);
    } else if (native == "last_hidden") {
      s.hidden = last_hidden;
    }
    emit(s, {first});
    if (s.finish.empty()) insert_row(&s);
  }

  void draft_prefill_chunk(Seq& s, const std::string& name, at::Tensor tokens, int64_t start, int64_t n,
                           const at::Tensor& target_hidden) {
    int64_t chunk = tokens.size(1), P = static_cast<int64_t>(s.prompt.size());
    int64_t m = std::min(n, P - offset - start);
    if (m <= 0) return;
    if (offset) {
      std::vector<int64_t> shifted(chunk, 0);
      std::copy(s.prompt.begin() + start + offset, s.prompt.begin() + start + offset + m, shifted.begin());
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

  // ---- decoding (Engine._decode) -----------------------------------------------------------------------

  bool speculates() const {  // Scheduler.speculates
    if (native.empty()) return false;
    const json dbbs = art.proposer.value("disable_by_batch_size", json());
    if (dbbs.is_number_integer() && static_cast<int64_t>(rows.size()) > dbbs.get<int64_t>()) return false;
    bool room = false;
    for (auto* s : rows) {
      if (static_cast<int64_t>(s->seq.size()) + art.max_depth > art.max_context) return false;
      room = room || s->budget - static_cast<int64_t>(s->out.size()) > 1;
    }
    return room;
  }

  bool can_speculate() {
    if (native != "ngram") return true;
    bool any = false;
    for (auto* s : rows) {
      s->ngram.extend(s->seq);
      s->proposal = s->ngram.propose(art.max_depth);
      any = any || !s->proposal.empty();
    }
    return any;
  }

  int64_t context_bucket() const {
    int64_t m = 1;
    for (auto* s : rows) m = std::max(m, s->committed());
    return art.context_bucket(m);
  }

  std::vector<std::vector<int64_t>> plain_step(const std::string& variant) {
    const json& step = art.step(B, context_bucket(), variant, std::nullopt);
    at::Tensor pos = positions.slice(0, 0, B);
    Named in = kv("target");
    in.merge(sampling());
    in["tokens"] = last_tokens.slice(0, 0, B);
    in["cache_len"] = pos;
    in["uniform"] = uniforms(0);
    Named o = call(step.at("decode"), in);
    commit_role("target", o, "new_k", "new_v", pos.unsqueeze(1));
    at::Tensor nxt = o.at("next_tokens");
    advance(nxt, at::ones({B}, at::kLong));
    at::Tensor hidden = o.at("hidden");
    std::vector<std::vector<int64_t>> out;
    for (size_t i = 0; i < rows.size(); ++i) {
      Seq& s = *rows[i];
      if (native == "cached_draft" && reads_hidden) s.hidden = at::cat({s.hidden, hidden.slice(0, i, i + 1)});
      if (native == "last_hidden") s.hidden = hidden[i];
      out.push_back({nxt[i].item<int64_t>()});
    }
    return out;
  }

  std::vector<int64_t> pending(const Seq& s) const {
    size_t from = std::min<size_t>(s.draft_length + offset, s.seq.size());
    return std::vector<int64_t>(s.seq.begin() + from, s.seq.end());
  }

  // CachedDraft.sync: bring every row's draft cache within one catch-up (D+1 entries) of its sequence.
  void sync(int64_t D, const std::string& variant) {
    int64_t chunk = art.chunk_buckets.back();
    while (true) {
      std::vector<int64_t> n(B, 0);
      bool behind = false;
      for (size_t i = 0; i < rows.size(); ++i) {
        int64_t lag = static_cast<int64_t>(pending(*rows[i]).size());
        if (lag > D + 1) n[i] = std::min(lag - 1, chunk), behind = true;
      }
      if (!behind) return;
      std::vector<int64_t> tok(B * chunk, 0);
      int64_t longest = 1;
      for (size_t i = 0; i < rows.size(); ++i) {
        auto p = pending(*rows[i]);
        std::copy(p.begin(), p.begin() + n[i], tok.begin() + i * chunk);
        longest = std::max(longest, rows[i]->draft_length);
      }
      at::Tensor start = per_row([](const Seq& s) { return s.draft_length; });
      std::string name = art.step(B, art.context_bucket(longest), variant, 0).at("sync");
      Named in = kv("draft");
      in["tokens"] = longs(tok).view({B, chunk});
      in["cache_len"] = start;
      in["n_valid"] = longs(n);
      if (reads_hidden) {
        const InputSpec* spec = art.graph(name).input("input_hidden");
        at::Tensor h = at::zeros(spec->shape, at::TensorOptions().dtype(spec->dtype));
        for (size_t i = 0; i < rows.size(); ++i)
          if (n[i]) h[i].narrow(0, 0, n[i]).copy_(rows[i]->hidden.narrow(0, 0, n[i]));
        in["input_hidden"] = h;
      }
      Named o = call(name, in);
      commit_role("draft", o, "new_k", "new_v", slot_range(start, chunk));
      for (size_t i = 0; i < rows.size(); ++i) {
        rows[i]->draft_length += n[i];
        if (reads_hidden) rows[i]->hidden = rows[i]->hidden.slice(0, n[i]);
      }
    }
  }

  Proposal propose(const json& step, int64_t D, const std::string& variant) {
    if (native == "ngram") {
      std::vector<int64_t> tok(B * (D + 1), 0);
      for (size_t i = 0; i < rows.size(); ++i) {
        const auto& p = rows[i]->proposal;
        for (int64_t j = 0; j < std::min<int64_t>(p.size(), D); ++j) tok[i * (D + 1) + 1 + j] = p[j];
      }
      at::Tensor tokens = longs(tok).view({B, D + 1});
      tokens.select(1, 0).copy_(last_tokens.slice(0, 0, B));
      return {tokens, {}};
    }
    std::string name = step.at("draft");
    const GraphIO& io = art.graph(name);
    Named in;
    if (native == "last_hidden") {
      const InputSpec* spec = io.input("hidden");
      at::Tensor h = at::zeros(spec->shape, at::TensorOptions().dtype(spec->dtype));
      for (size_t i = 0; i < rows.size(); ++i) h[i].copy_(rows[i]->hidden);
      in["hidden"] = h;
      in["root"] = last_tokens.slice(0, 0, B);
      if (takes(io, "temperature")) in.merge(sampling());
      if (takes(io, "uniforms")) in["uniforms"] = uniforms(D);
      Named o = call(name, in);
      return {o.at("tree_tokens"), {}};
    }
    sync(D, variant);
    std::vector<int64_t> catch_tokens(B * (D + 1), 0);
    std::vector<int64_t> caught(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      auto p = pending(*rows[i]);
      std::copy(p.begin(), p.end(), catch_tokens.begin() + i * (D + 1));
      caught[i] = static_cast<int64_t>(p.size());
    }
    at::Tensor draft_len = per_row([](const Seq& s) { return s.draft_length; });
    std::vector<int64_t> n_catch(B, 1);  // padding rows catch up one entry, as in Python
    std::copy(caught.begin(), caught.end(), n_catch.begin());
    in = kv("draft");
    in["catch_tokens"] = longs(catch_tokens).view({B, D + 1});
    in["n_catch"] = longs(n_catch);
    in["draft_len"] = draft_len;
    if (takes(io, "temperature")) in.merge(sampling());
    if (takes(io, "uniforms")) in["uniforms"] = uniforms(D);
    if (reads_hidden) {
      const InputSpec* spec = io.input("catch_hidden");
      at::Tensor h = at::zeros(spec->shape, at::TensorOptions().dtype(spec->dtype));
      for (size_t i = 0; i < rows.size(); ++i) h[i].narrow(0, 0, rows[i]->hidden.size(0)).copy_(rows[i]->hidden);
      in["catch_hidden"] = h;
    }
    Named o = call(name, in);
    commit_role("draft", o, "catch_k", "catch_v", slot_range(draft_len, D + 1));
    for (size_t i = 0; i < rows.size(); ++i) rows[i]->draft_length += caught[i];
    return {o.at("tree_tokens"), o.count("parents") ? o.at("parents") : at::Tensor()};
  }

  std::vector<std::vector<int64_t>> speculative_step(const std::string& variant, int shape) {
    int64_t D = art.depths.at(shape);
    const json& step = art.step(B, context_bucket(), variant, shape);
    at::Tensor root_pos = positions.slice(0, 0, B).clone();
    Proposal prop = propose(step, D, variant);
    std::string name = step.at("verify");
    const GraphIO& io = art.graph(name);
    Named in = kv("target");
    in["tree_tokens"] = prop.tokens;
    in["root_pos"] = root_pos;
    if (takes(io, "parents")) in["parents"] = prop.parents;
    if (takes(io, "uniforms")) in["uniforms"] = uniforms(D + 1);
    if (takes(io, "temperature")) in.merge(sampling());
    Named o = call(name, in);
    commit_role("target", o, "path_k", "path_v", slot_range(root_pos, D + 1));
    at::Tensor n_acc = o.at("num_accepted"), tokens = o.at("tokens");
    advance(tokens.gather(1, n_acc.unsqueeze(1)).squeeze(1), n_acc + 1);
    at::Tensor path_hidden = o.at("path_hidden");
    auto acc = tokens.accessor<int64_t, 2>();
    std::vector<std::vector<int64_t>> out;
    for (size_t i = 0; i < rows.size(); ++i) {
      Seq& s = *rows[i];
      std::vector<int64_t> toks;
      for (int64_t j = 0; j < tokens.size(1); ++j)
        if (acc[i][j] >= 0) toks.push_back(acc[i][j]);
      int64_t accepted = static_cast<int64_t>(toks.size()) - 1;
      s.stats.drafts += 1;
      s.stats.draft_tokens += D;
      s.stats.accepted += accepted;
      for (int64_t j = 0; j < accepted; ++j) s.stats.per_position[j] += 1;
      if (native == "cached_draft" && reads_hidden) s.hidden = path_hidden[i].slice(0, 0, accepted + 1);
      if (native == "last_hidden") s.hidden = path_hidden[i][accepted];
      out.push_back(std::move(toks));
    }
    return out;
  }

  void decode() {
    static const std::vector<std::string> order = {"greedy", "plain", "filtered"};
    size_t wanted = 0;
    for (auto* s : rows)
      wanted = std::max<size_t>(wanted, std::find(order.begin(), order.end(), s->variant) - order.begin());
    std::string variant = art.variant_for(order[wanted]);
    bool speculate = speculates() && can_speculate();
    int shape = speculate ? 0 : -1;
    bool choose = speculate && adaptive && variant == "greedy";
    if (choose) shape = adaptive->choose();
    auto t0 = Clock::now();
    auto toks = shape < 0 ? plain_step(variant) : speculative_step(variant, shape);
    if (choose) {
      int64_t n = 0;
      for (const auto& t : toks) n += static_cast<int64_t>(t.size());
      adaptive->record(shape, n, seconds(t0, Clock::now()));
    }
    std::vector<Seq*> stepped = rows;
    for (size_t i = 0; i < stepped.size(); ++i) emit(*stepped[i], toks[i]);
    for (int64_t i = static_cast<int64_t>(rows.size()) - 1; i >= 0; --i)
      if (!rows[i]->finish.empty()) remove_row(i);
  }

  void step() {  // Engine.step: admission is decided before the step runs (Engine._schedule)
    if (!prefilling && !waiting.empty() && static_cast<int64_t>(rows.size()) < num_slots) {
      prefilling = waiting.front();
      waiting.pop_front();
    }
    if (!rows.empty()) decode();
    if (prefilling) prefill_chunk(*prefilling);
  }
};

Runner::Runner(const Artifacts& art, Executor& exec, int64_t max_num_seqs)
    : impl_(std::make_unique<Impl>(art, exec, max_num_seqs)) {}
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
                     "'exact' to sample");
}

std::vector<Result> Runner::generate(const std::vector<std::vector<int64_t>>& prompts, const Params& params,
                                     const std::function<void(size_t, const std::string&)>& on_bytes,
                                     const std::function<void(size_t, const Result&)>& on_result) {
  for (const auto& p : prompts) check(p, params);
  Impl& e = *impl_;
  e.params = params;
  e.on_bytes = on_bytes;
  std::vector<Seq> seqs(prompts.size());
  std::vector<Result> results(prompts.size());
  e.on_finish = [&](Seq& s) {
    auto t_end = Clock::now();
    Result& r = results[s.index];
    r.token_ids = s.out;
    std::string bytes;
    for (auto t : s.out) bytes += e.art.token_bytes(t);
    r.text = utf8_lossy(bytes);
    r.finish_reason = s.finish;
    r.num_prompt_tokens = static_cast<int64_t>(s.prompt.size());
    r.ttft_s = seconds(s.t0, s.t_first);
    int64_t n = static_cast<int64_t>(s.out.size());
    double dt = seconds(s.t_first, t_end);
    r.decode_tokens_per_s = n > 1 && dt > 0 ? (n - 1) / dt : 0.0;
    r.prefill_tokens_per_s = r.ttft_s > 0 ? s.prompt.size() / r.ttft_s : 0.0;
    if (!e.native.empty()) r.spec = s.stats;
    if (on_result) on_result(s.index, r);
  };
  const json& proposer = e.art.proposer;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Seq& s = seqs[i];
    s.index = i;
    s.prompt = prompts[i];
    s.variant = variant_of(params);
    s.budget = std::min(params.max_tokens, e.art.max_context - static_cast<int64_t>(s.prompt.size()));
    std::random_device entropy;
    s.seed = params.seed ? static_cast<uint64_t>(*params.seed) : (uint64_t{entropy()} << 32 | entropy());
    s.stats = SpecStats{0, 0, 0, std::vector<int64_t>(e.art.max_depth, 0)};
    auto count = [&](const char* key) {  // null for proposers other than n-gram
      const json v = proposer.is_null() ? json() : proposer.value(key, json());
      return v.is_number_integer() ? v.get<int64_t>() : int64_t{1};
    };
    s.ngram.min_n = count("prompt_lookup_min");
    s.ngram.max_n = count("prompt_lookup_max");
    e.waiting.push_back(&s);
  }
  while (!e.rows.empty() || e.prefilling || !e.waiting.empty()) e.step();
  return results;
}

}  // namespace specair
