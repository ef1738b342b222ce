"""Acceptance samplers: greedy, exact (plain decoding's sample at every position), typical; the uniforms."""

import math

import numpy as np
import pytest
import torch

from specair.graphs.acceptance import accept_exact, accept_greedy, accept_typical
from specair.graphs.sampling import logits_to_probs, position_uniforms
from specair.graphs.tree import TreeTemplate, buffers_from_parents, chain, from_choices, get_template, kary


def params(B, temperature=1.0, top_k=0, top_p=1.0, dtype=torch.float64):
    return (torch.full((B,), temperature, dtype=dtype), torch.full((B,), top_k, dtype=torch.long),
            torch.full((B,), top_p, dtype=dtype))


def expected_probs(logits, temperature, top_k, top_p):
    """The target distribution as the non-speculative sampler defines it (argmax at temperature 0)."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return logits_to_probs(logits, *params(logits.shape[0], temperature, top_k, top_p, logits.dtype))


def peaked(argmaxes, V, seed=0):
    """Logits [1, T, V] whose argmax at node i is argmaxes[i]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, len(argmaxes), V, generator=g)
    logits[0, torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return logits


def expand(t, B):
    return t.expand(B, *t.shape)


# ----------------------------------------------------------------------------------------------- greedy


def greedy(tokens, argmaxes, tree, V=6):
    b = tree.buffers()
    return accept_greedy(torch.tensor([tokens]), peaked(argmaxes, V), expand(b.paths, 1))


def test_greedy_chain_partial_and_full_match():
    r = greedy([9, 2, 3, 4], [2, 3, 1, 0], chain(3), V=10)
    assert r.num_accepted.tolist() == [2]
    assert r.tokens.tolist() == [[2, 3, 1, -1]] and r.node_ids.tolist() == [[0, 1, 2, -1]]
    r = greedy([9, 2, 3, 1], [2, 3, 1, 0], chain(3), V=10)
    assert r.num_accepted.tolist() == [3]
    assert r.tokens.tolist() == [[2, 3, 1, 0]] and r.node_ids.tolist() == [[0, 1, 2, 3]]


def test_greedy_no_match_gives_root_argmax():
    r = greedy([0, 1, 2, 3], [5, 3, 1, 0], chain(3))
    assert r.num_accepted.tolist() == [0]
    assert r.tokens.tolist() == [[5, -1, -1, -1]] and r.node_ids.tolist() == [[0, -1, -1, -1]]


def test_greedy_picks_the_matching_branch_and_the_longest_path():
    t = kary(2, 2)  # nodes: 1, 2 under the root; 3, 4 under 1; 5, 6 under 2
    #                 root n1 n2 n3 n4 n5 n6          argmax at each node
    r = greedy([0, 1, 4, 0, 0, 0, 3], [4, 0, 3, 1, 1, 2, 5], t)
    assert r.node_ids.tolist() == [[0, 2, 6]] and r.tokens.tolist() == [[4, 3, 5]]
    # Both depth-1 siblings match; only the second one's subtree continues: the longest path wins.
    r = greedy([0, 4, 4, 1, 1, 3, 0], [4, 2, 3, 1, 1, 2, 5], t)
    assert r.node_ids.tolist() == [[0, 2, 5]] and r.tokens.tolist() == [[4, 3, 2]]
    # Two equally long matching paths: the lowest node id.
    r = greedy([0, 4, 4, 2, 1, 3, 0], [4, 2, 3, 1, 1, 2, 5], t)
    assert r.node_ids.tolist() == [[0, 1, 3]] and r.tokens.tolist() == [[4, 2, 1]]


def reference_longest_path(ok, parents):
    """Plain-Python longest all-ok root path, ties to the lowest node id."""
    best, best_depth = 0, 0
    for i in range(1, len(parents)):
        path, j = [], i
        while j > 0:
            path.append(j)
            j = parents[j]
        if all(ok[j] for j in path) and len(path) > best_depth:
            best, best_depth = i, len(path)
    return best


BRANCHY = from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]])


def random_branchy(B=200, V=3, seed=1):
    """BRANCHY's buffers, random tokens [B, T], logits [B, T, V] and the generator that drew them."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, BRANCHY.num_nodes), generator=g)
    return BRANCHY.buffers(), tokens, torch.randn(B, BRANCHY.num_nodes, V, generator=g), g


def test_greedy_matches_reference_on_random_trees():
    t, B = BRANCHY, 200
    b, tokens, logits, _ = random_branchy(B)
    r = accept_greedy(tokens, logits, expand(b.paths, B))
    am = logits.argmax(-1)
    for row in range(B):
        ok = [True] + [tokens[row, i] == am[row, t.parents[i]] for i in range(1, t.num_nodes)]
        best = reference_longest_path(ok, t.parents)
        assert r.node_ids[row].tolist() == b.paths[best].tolist()
        n = int(b.depth[best])
        assert r.tokens[row, n] == am[row, best]


# ------------------------------------------------------------------------------------------------ exact


def reference_sample(logits, temperature, top_k, top_p, u):
    """One token: the first whose cumulative probability exceeds u (argmax at temperature 0)."""
    p = expected_probs(logits[None].double(), temperature, top_k, top_p)[0]
    cdf = p.cumsum(0)
    return int((cdf <= u * cdf[-1]).sum().clamp(max=len(p) - 1))


def reference_exact(tokens, logits, tree, u, setting):
    """Plain decoding along the tree: the target's sample at every node (with the uniform of its children's
    depth); the longest path of nodes holding their parent's sample (ties: lowest id; with distinct
    siblings, the one walk that follows the samples). Returns (node ids on the path, tokens emitted)."""
    depth, parents = tree.buffers().depth.tolist(), tree.parents
    decided = [reference_sample(logits[i], *setting, float(u[depth[i]])) for i in range(len(parents))]
    best = reference_longest_path([True] + [tokens[i] == decided[parents[i]] for i in range(1, len(parents))],
                                  parents)
    path = [best]
    while path[-1] > 0:
        path.append(parents[path[-1]])
    path = path[::-1]
    return path, [tokens[i] for i in path[1:]] + [decided[best]]


EXACT_TREES = [chain(3), kary(2, 2), from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
               get_template("mc_sim_7b_63", 4)]
SETTINGS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 4, 1.0), (0.9, 0, 0.8), (0.8, 3, 0.9)]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "T{}-k{}-p{}".format(*s))
@pytest.mark.parametrize("tree", EXACT_TREES, ids=lambda t: f"{t.num_nodes}nodes-depth{t.max_depth}")
def test_exact_emits_plain_decodings_sample_at_every_position(tree, setting):
    """Every accepted token and the final one are the target's own sample at that position, taken with
    that position's uniform: what plain decoding with the same uniforms gives."""
    b, B, V, T, D = tree.buffers(), 64, 6, tree.num_nodes, tree.max_depth
    g = torch.Generator().manual_seed(T)
    logits = 2 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    u = torch.rand(B, D + 1, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    for i in range(1, T):  # make most drafts right, so the walks go deep
        right = [reference_sample(logits[r, tree.parents[i]], *setting, float(u[r, b.depth[i] - 1]))
                 for r in range(B)]
        tokens[:, i] = torch.where(torch.rand(B, generator=g) < 0.7, torch.tensor(right), tokens[:, i])
    r = accept_exact(tokens, logits, expand(b.paths, B), u, *params(B, *setting))
    for row in range(B):
        path, out = reference_exact(tokens[row].tolist(), logits[row], tree, u[row], setting)
        n = len(path) - 1
        assert r.num_accepted[row] == n
        assert r.node_ids[row].tolist() == path + [-1] * (D - n)
        assert r.tokens[row].tolist() == out + [-1] * (D - n)
    assert r.num_accepted.float().mean() > 1


def test_exact_at_temperature_zero_is_greedy():
    B = 200
    b, tokens, logits, g = random_branchy(B)
    u = torch.rand(B, BRANCHY.max_depth + 1, generator=g)
    got = accept_exact(tokens, logits, expand(b.paths, B), u, *params(B, 0.0, dtype=torch.float32))
    for x, y in zip(got, accept_greedy(tokens, logits, expand(b.paths, B))):
        assert torch.equal(x, y)


def test_exact_follows_the_target_whatever_the_draft():
    """Monte Carlo on a Markov target: drafts sampled from a different model (independently of the
    uniforms) leave the first two tokens' distribution the target's, and the tree is used."""
    V, N, setting = 32, 100_000, (0.9, 0, 0.95)
    tree = from_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    g = torch.Generator().manual_seed(11)
    target = 2.0 * torch.randn(V, V, generator=g, dtype=torch.float64)
    draft = target + torch.randn(V, V, generator=g, dtype=torch.float64)
    b, T = tree.buffers(), tree.num_nodes
    toks = torch.zeros(N, T, dtype=torch.long)
    for i in range(1, T):
        toks[:, i] = torch.multinomial(draft[toks[:, tree.parents[i]]].softmax(-1), 1, generator=g).squeeze(1)
    u = torch.rand(N, tree.max_depth + 1, generator=g, dtype=torch.float64)
    r = accept_exact(toks, target[toks], expand(b.paths, N), u, *params(N, *setting))
    tp = expected_probs(target, *setting)
    t1 = r.tokens[:, 0]
    # A step that emitted one token is continued by plain decoding (the next step's first token).
    t2 = torch.where(r.num_accepted > 0, r.tokens[:, 1], torch.multinomial(tp[t1], 1, generator=g).squeeze(1))
    for got, want in ((t1, tp[0]), (t2, tp[0] @ tp)):
        emp = torch.bincount(got, minlength=V).double() / N
        bound = (want * (1 - want) / N).sqrt().sum().item()  # E|p_hat - p| <= sqrt(p(1-p)/N) per token
        assert 0.5 * (emp - want).abs().sum().item() < bound
    assert r.num_accepted.float().mean() > 0.1


def test_a_draft_sampling_with_the_same_uniform_is_accepted_with_the_cdf_overlap():
    """One drafted token sampled by inverse CDF from the draft with the uniform the target will use: it is
    accepted exactly when both samples agree, with probability sum_x |[F(x-), F(x)) ∩ [G(x-), G(x))|, more
    than an independently sampled draft's sum_x p(x) q(x)."""
    V, N = 32, 100_000
    g = torch.Generator().manual_seed(3)
    target = 2.0 * torch.randn(V, generator=g, dtype=torch.float64)
    p, q = target.softmax(-1), (target + 0.5 * torch.randn(V, generator=g, dtype=torch.float64)).softmax(-1)
    u = torch.rand(N, 2, generator=g, dtype=torch.float64)
    drafted = (q.cumsum(0) <= u[:, :1]).sum(-1).clamp(max=V - 1)
    toks = torch.stack([torch.zeros(N, dtype=torch.long), drafted], 1)
    r = accept_exact(toks, target.expand(N, 2, V), expand(chain(1).buffers().paths, N), u, *params(N))
    F, G = p.cumsum(0), q.cumsum(0)
    overlap = (torch.minimum(F, G) - torch.maximum(F - p, G - q)).clamp(min=0).sum().item()
    rate = r.num_accepted.double().mean().item()
    assert abs(rate - overlap) < 5 * math.sqrt(overlap * (1 - overlap) / N)
    assert overlap > (p * q).sum().item() + 0.1


def splitmix64_reference(seed, position):
    """graphs/sampling.position_uniforms in plain Python integers."""
    mask = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    return mix((mix(seed & mask) + position * 0x9E3779B97F4A7C15) & mask)


def test_position_uniforms_are_a_function_of_seed_and_position():
    for dtype, bits in ((torch.float32, 24), (torch.float64, 53)):
        u = position_uniforms(7, np.arange(1000, 1010), dtype)
        assert u.dtype == dtype
        want = [(splitmix64_reference(7, p) >> (64 - bits)) / 2 ** bits for p in range(1000, 1010)]
        assert u.tolist() == want
        assert position_uniforms(7, np.array([1004]), dtype).item() == u[4].item()  # no stream to replay
    assert position_uniforms(-3, np.arange(3), torch.float64).tolist() == [
        (splitmix64_reference(-3, p) >> 11) / 2 ** 53 for p in range(3)]
    many = position_uniforms(1, np.arange(200_000), torch.float32).double()
    assert 0 <= many.min() and many.max() < 1
    assert abs(many.mean().item() - 0.5) < 0.005 and abs(many.var().item() - 1 / 12) < 0.002
    assert not torch.equal(position_uniforms(2, np.arange(8), torch.float32),
                           position_uniforms(1, np.arange(8), torch.float32))
    assert abs(torch.corrcoef(torch.stack([many[:-1], many[1:]]))[0, 1].item()) < 0.01


# ------------------------------------------------------------------------------------------------ typical


def entropy(p):
    return -sum(x * math.log(x + 1e-5) for x in p)


def test_typical_hand_computed_thresholds():
    pa = [0.30, 0.29, 0.28, 0.085, 0.045]  # flat: the entropy threshold applies (below 0.09)
    pb = [0.85, 0.12, 0.02, 0.01, 0.0]  # peaked: 0.09 applies
    thr_a = 0.3 * math.exp(-entropy(pa))
    thr_b = 0.3 * math.exp(-entropy(pb))
    assert 0.045 < thr_a < 0.085 < 0.09  # 0.085 passes only because of the entropy branch
    assert 0.02 < 0.09 < 0.12 < thr_b  # 0.12 passes only because of the posterior_threshold branch
    logits = torch.tensor([pa, pb, [0.1, 0.2, 0.3, 0.35, 0.05]]).clamp(min=1e-30).log()[None].expand(4, -1, -1)
    tokens = torch.tensor([[7, 3, 1], [7, 3, 2], [7, 4, 1], [7, 0, 3]])
    paths = expand(chain(2).buffers().paths, 4)
    r = accept_typical(tokens, logits, paths, *params(4, dtype=torch.float32))
    assert r.num_accepted.tolist() == [2, 1, 0, 1]
    assert r.tokens.tolist() == [[3, 1, 3], [3, 0, -1], [0, -1, -1], [0, 0, -1]]
    assert r.node_ids.tolist() == [[0, 1, 2], [0, 1, -1], [0, -1, -1], [0, 1, -1]]


def test_typical_temperature_zero_is_greedy_and_matches_reference():
    t = BRANCHY
    b, B, V = t.buffers(), 200, 5
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, V, (B, t.num_nodes), generator=g)
    logits = 2 * torch.randn(B, t.num_nodes, V, generator=g)
    paths = expand(b.paths, B)
    temperature = torch.where(torch.arange(B) % 2 == 0, 0.0, 0.8)
    top_k, top_p = torch.full((B,), 4), torch.full((B,), 0.9)
    r = accept_typical(tokens, logits, paths, temperature, top_k, top_p)
    g0 = accept_greedy(tokens, logits, paths)
    for x, y in zip(r, g0):
        assert torch.equal(x[::2], y[::2])
    probs = logits_to_probs(logits, temperature, top_k, top_p).double()
    for row in range(1, B, 2):
        thr = [min(0.09, 0.3 * math.exp(-entropy(probs[row, i].tolist()))) for i in range(t.num_nodes)]
        ok = [True] + [probs[row, t.parents[i], tokens[row, i]] > thr[t.parents[i]] for i in range(1, t.num_nodes)]
        best = reference_longest_path(ok, t.parents)
        assert r.node_ids[row].tolist() == b.paths[best].tolist()
        assert r.tokens[row, b.depth[best]] == logits[row, best].argmax()


# ------------------------------------------------------------------------------ batch padding, compilation


def random_inputs(tree: TreeTemplate, B, V, seed, dtype=torch.float32, max_depth=None):
    g = torch.Generator().manual_seed(seed)
    T = tree.num_nodes
    tokens = torch.randint(0, V, (B, T), generator=g)
    logits = 3 * torch.randn(B, T, V, generator=g, dtype=dtype)
    # make some drafts right so the walks go deep
    tokens[:, 1:] = torch.where(torch.rand(B, T - 1, generator=g) < 0.6,
                                logits.argmax(-1)[:, list(tree.parents[1:])], tokens[:, 1:])
    u = torch.rand(B, (max_depth or tree.max_depth) + 1, generator=g, dtype=dtype)  # one per depth of `paths`
    temperature = torch.rand(B, generator=g, dtype=dtype) * 1.5
    temperature[0] = 0.0
    top_k = torch.randint(0, V, (B,), generator=g)
    top_p = 0.5 + 0.5 * torch.rand(B, generator=g, dtype=dtype)
    return tokens, logits, u, temperature, top_k, top_p


def run_all(bufs, inputs):
    tokens, logits, u, temperature, top_k, top_p = inputs
    return (accept_greedy(tokens, logits, bufs.paths),
            accept_typical(tokens, logits, bufs.paths, temperature, top_k, top_p),
            accept_exact(tokens, logits, bufs.paths, u, temperature, top_k, top_p))


def test_padded_rows_do_not_change_real_rows():
    tree, V, R, P = kary(2, 2), 16, 5, 7
    T = tree.num_nodes
    real = random_inputs(tree, R, V, seed=0, max_depth=T - 1)
    pad = list(random_inputs(tree, P, V, seed=1, max_depth=T - 1))
    pad[0] = torch.randint(-100, 100, (P, T))  # out-of-range tokens
    pad[1][0, 0] = float("nan")
    pad[1][1] = float("inf")
    pad[1][2, 3] = float("-inf")
    pad[2][3] = float("nan")  # a uniform
    g = torch.Generator().manual_seed(2)
    # padded rows may also carry another (valid) tree shape
    parents = torch.cat([torch.tensor([tree.parents] * R),
                         torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g))
                                                           for i in range(1, T)]) for _ in range(P)])])
    bufs = buffers_from_parents(parents, T - 1, T - 1)
    alone = run_all(type(bufs)(*(x[:R] for x in bufs)), real)
    mixed = run_all(bufs, [torch.cat([a, b]) for a, b in zip(real, pad)])
    for x, y in zip(alone, mixed):
        for a, b in zip(x, y):
            assert torch.equal(a, b[:R])


def test_acceptance_compiles_once_and_matches_eager():
    tree, B, V = kary(2, 2), 4, 16
    b = tree.buffers()
    bufs = type(b)(*(expand(x, B) if isinstance(x, torch.Tensor) else x for x in b))
    fns = {
        "greedy": lambda tk, lg, u, t, k, p: accept_greedy(tk, lg, bufs.paths),
        "typical": lambda tk, lg, u, t, k, p: accept_typical(tk, lg, bufs.paths, t, k, p),
        "exact": lambda tk, lg, u, t, k, p: accept_exact(tk, lg, bufs.paths, u, t, k, p),
    }
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for name, fn in fns.items():
            compiled = torch.compile(fn, fullgraph=True, dynamic=False)
            for seed in (0, 1):
                inputs = random_inputs(tree, B, V, seed)
                want, got = fn(*inputs), compiled(*inputs)
                for x, y in zip(want, got):
                    assert torch.equal(x, y), name
