"""Acceptance samplers: greedy, exact tree rejection sampling (by enumeration and Monte Carlo), typical."""

import itertools
import math

import pytest
import torch

from specair.graphs.acceptance import accept_greedy, accept_rejection, accept_typical
from specair.graphs.sampling import logits_to_probs, sample_from_probs
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


def test_greedy_matches_reference_on_random_trees():
    t = from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]])
    b, B, V = t.buffers(), 200, 3
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (B, t.num_nodes), generator=g)
    logits = torch.randn(B, t.num_nodes, V, generator=g)
    r = accept_greedy(tokens, logits, expand(b.paths, B))
    am = logits.argmax(-1)
    for row in range(B):
        ok = [True] + [tokens[row, i] == am[row, t.parents[i]] for i in range(1, t.num_nodes)]
        best = reference_longest_path(ok, t.parents)
        assert r.node_ids[row].tolist() == b.paths[best].tolist()
        n = int(b.depth[best])
        assert r.tokens[row, n] == am[row, best]


# ------------------------------------------------------------------------------- exact rejection sampling


class World:
    """A tiny target and draft model: logits tables indexed by the drafted tokens (the context)."""

    def __init__(self, V, depth, seed):
        g = torch.Generator().manual_seed(seed)
        self.V = V
        self.target = [2.0 * torch.randn(*(V,) * (d + 1), generator=g, dtype=torch.float64) for d in range(depth + 1)]
        noise = [torch.randn(*(V,) * (d + 1), generator=g, dtype=torch.float64) for d in range(depth + 1)]
        self.draft = [t + n for t, n in zip(self.target, noise)]

    def table_probs(self, d, temperature, top_k, top_p):
        """Target distribution for every context of length d: [V]*d + [V]."""
        flat = self.target[d].reshape(-1, self.V)
        return expected_probs(flat, temperature, top_k, top_p).view(self.target[d].shape)

    @staticmethod
    def at(table, tokens, path):
        """table[ctx] for the context = tokens on path (root excluded); tokens [N, T] -> [N, V]."""
        ctx = tuple(tokens[:, j] for j in path[1:] if j >= 0)
        return table[ctx] if ctx else table.expand(tokens.shape[0], -1)


def draft_setups(world, tree, mode):
    """All draft outcomes as (tokens [N, T], draft_probs [N, T, V], weights [N])."""
    b, V, T = tree.buffers(), world.V, tree.num_nodes
    paths = b.paths.tolist()
    q_at = lambda toks, i: world.at(world.draft[b.depth[i] - 1], toks, paths[tree.parents[i]]).softmax(-1)
    if mode == "topk":  # siblings are the parent's top-ranked draft tokens; one-hot q
        toks = torch.zeros(1, T, dtype=torch.long)
        for i in range(1, T):
            toks[0, i] = q_at(toks, i)[0].argsort(descending=True, stable=True)[tree.ranks[i]]
        q = torch.nn.functional.one_hot(toks, V).double()
        return toks, q, torch.ones(1, dtype=torch.float64)
    # sampled: every node i.i.d. from the draft at its parent, all V**(T-1) outcomes enumerated
    toks = torch.tensor(list(itertools.product(range(V), repeat=T - 1)))
    toks = torch.cat([torch.zeros(len(toks), 1, dtype=torch.long), toks], 1)
    q = torch.stack([torch.zeros(len(toks), V, dtype=torch.float64)] + [q_at(toks, i) for i in range(1, T)], 1)
    w = torch.ones(len(toks), dtype=torch.float64)
    for i in range(1, T):
        w = w * q[:, i].gather(1, toks[:, i:i + 1]).squeeze(1)
    return toks, q, w


def enumerate_rejection(world, tree, mode, setting):
    """Run accept_rejection over every draft outcome and every accept/reject pattern; return the rows."""
    b, T = tree.buffers(), tree.num_nodes
    toks, q, w = draft_setups(world, tree, mode)
    logits = torch.stack([world.at(world.target[b.depth[i]], toks, b.paths[i].tolist()) for i in range(T)], 1)
    bits = torch.tensor(list(itertools.product([True, False], repeat=T - 1)))  # forced outcome per node
    A, P = len(toks), len(bits)
    rep = lambda x: x.repeat_interleave(P, 0)
    toks, q, w, logits = rep(toks), rep(q), rep(w), rep(logits)
    bits = bits.repeat(A, 1)
    f64 = dict(dtype=torch.float64)
    forced = torch.where(bits, torch.tensor(0.0, **f64), torch.tensor(1 - 1e-9, **f64))  # accept iff a > 0 / a == 1
    u = torch.cat([torch.zeros(A * P, 1, **f64), forced, torch.full((A * P, 1), 0.5, **f64)], 1)
    # Deterministic candidates go in as the runtime passes them: tokens only, the one-hot q implied.
    r, accept_prob, final = accept_rejection(
        toks, logits, None if mode == "topk" else q, expand(b.children, A * P), u, *params(A * P, *setting),
        max_depth=tree.max_depth, return_probs=True)
    # Unvisited nodes report accept_prob 0, so only their "reject" pattern keeps weight: no double counting.
    w = w * torch.where(bits, accept_prob[:, 1:], 1 - accept_prob[:, 1:]).prod(-1)
    return r, w, final


def emitted_joint(world, r, w, final, setting, m):
    """P(first m tokens) when the step's output is continued by the target itself (the next steps)."""
    V = world.V
    tp = [world.table_probs(d, *setting) for d in range(m)]
    joint = torch.zeros(V ** m, dtype=torch.float64)
    n = r.num_accepted
    full = n >= m
    idx = sum(r.tokens[full, k] * V ** (m - 1 - k) for k in range(m))
    joint.index_add_(0, idx, w[full])
    for k in range(m):  # k tokens accepted: the final token, then target continuations
        rows = n == k
        if not rows.any():
            continue
        prefix = tuple(r.tokens[rows, j] for j in range(k))
        dist = final[rows]
        for pos in range(k + 1, m):
            table = tp[pos]
            cond = table[prefix] if k else table.expand(int(rows.sum()), *table.shape)
            dist = dist[..., None] * cond
        pidx = sum((prefix[j] * V ** (k - 1 - j) for j in range(k)), torch.zeros_like(w[rows], dtype=torch.long))
        joint.view(V ** k, -1).index_add_(0, pidx, w[rows, None] * dist.reshape(int(rows.sum()), -1))
    want = tp[0]
    for pos in range(1, m):
        want = want[..., None] * tp[pos]
    return joint.view((V,) * m), want


SETTINGS = [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (0.8, 3, 0.7), (0.0, 0, 1.0)]
TREES = [
    ("chain3-sampled", chain(3), "sampled", 8),
    ("kary2x2-topk", kary(2, 2), "topk", 8),
    ("3-at-root-topk", from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]), "topk", 8),
    ("iid-siblings-sampled", from_choices([[0], [1], [2], [0, 0], [0, 1]]), "sampled", 4),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "T{}-k{}-p{}".format(*s))
@pytest.mark.parametrize("name,tree,mode,V", TREES, ids=[c[0] for c in TREES])
def test_rejection_is_exact_by_enumeration(name, tree, mode, V, setting):
    world = World(V, tree.max_depth, seed=sum(map(ord, name)))
    r, w, final = enumerate_rejection(world, tree, mode, setting)
    assert abs(w.sum().item() - 1) < 1e-9
    m = min(tree.max_depth + 1, 3)
    joint, want = emitted_joint(world, r, w, final, setting, m)
    first = joint.reshape(V, -1).sum(-1)
    assert (first - want.reshape(V, -1).sum(-1)).abs().max() < 1e-6  # P(first token = x) = p_root(x)
    pair = joint.reshape(V, V, -1).sum(-1)
    assert (pair - want.reshape(V, V, -1).sum(-1)).abs().max() < 1e-6  # P(x1, y) = p_root(x1) p_x1(y)
    assert (joint - want).abs().max() < 1e-6
    if setting[0] > 0:
        assert (r.num_accepted[w > 0] > 0).any()  # the test walks into the tree


@pytest.mark.parametrize("name,tree,mode,V", TREES, ids=[c[0] for c in TREES])
def test_rejection_decisions_match_returned_probs(name, tree, mode, V):
    world = World(V, tree.max_depth, seed=3)
    toks, q, _ = draft_setups(world, tree, mode)
    b, T = tree.buffers(), tree.num_nodes
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, len(toks), (512,), generator=g)
    toks, q = toks[rows], q[rows]
    logits = torch.stack([world.at(world.target[b.depth[i]], toks, b.paths[i].tolist()) for i in range(T)], 1)
    u = torch.rand(len(rows), T + 1, generator=g, dtype=torch.float64)
    r, a, final = accept_rejection(toks, logits, q, expand(b.children, len(rows)), u, *params(len(rows), 0.9, 0, 0.9),
                                   max_depth=tree.max_depth, return_probs=True)
    assert torch.allclose(final.sum(-1), torch.ones(len(rows), dtype=torch.float64))
    for row in range(len(rows)):
        n = int(r.num_accepted[row])
        ids = r.node_ids[row].tolist()
        assert ids[0] == 0 and all(x == -1 for x in ids[n + 1:])
        for k in range(n):
            assert tree.parents[ids[k + 1]] == ids[k]
            assert r.tokens[row, k] == toks[row, ids[k + 1]]
        for i in range(1, T):
            if a[row, i] > 0:
                assert (i in ids) == bool(u[row, i] < a[row, i])
            else:
                assert i not in ids
        assert r.tokens[row, n] == sample_from_probs(final[row], u[row, T])
        assert (r.tokens[row, n + 1:] == -1).all()


def test_rejection_at_temperature_zero_is_greedy():
    t = kary(2, 3)
    b, B, V = t.buffers(), 300, 4
    g = torch.Generator().manual_seed(2)
    toks = torch.randint(0, V, (B, t.num_nodes), generator=g)
    for row in range(B):  # distinct siblings: with duplicates the two may pick different equal-length paths
        for kids in b.children.tolist():
            kids = [c for c in kids if c >= 0]
            if kids:
                toks[row, kids] = torch.randperm(V, generator=g)[: len(kids)]
    logits = torch.randn(B, t.num_nodes, V, generator=g)
    q = torch.randn(B, t.num_nodes, V, generator=g).softmax(-1)
    u = torch.rand(B, t.num_nodes + 1, generator=g)
    got = accept_rejection(toks, logits, q, expand(b.children, B), u, *params(B, 0.0, dtype=torch.float32),
                           max_depth=t.max_depth)
    want = accept_greedy(toks, logits, expand(b.paths, B))
    for x, y in zip(got, want):
        assert torch.equal(x, y)


def naive_first_token(p, q, W):
    """The biased rule: W i.i.d. siblings x_j ~ q each tested against the UNMODIFIED p, first accepted wins,
    else a sample from normalize(max(0, p - q)). Exact distribution of the emitted token, by enumeration."""
    V = len(p)
    resid = (p - q).clamp(min=0)
    resid = resid / resid.sum()
    a = (p / q).clamp(max=1)
    out = torch.zeros(V, dtype=torch.float64)
    for xs in itertools.product(range(V), repeat=W):
        reach = math.prod(q[x].item() for x in xs)
        for x in xs:
            out[x] += reach * a[x]
            reach *= 1 - a[x]
        out += reach * resid
    return out


def test_independent_sibling_tests_are_biased_but_mss_is_not():
    V, W = 4, 3
    tree = from_choices([[0], [1], [2]])
    world = World(V, 1, seed=7)
    setting = (1.0, 0, 1.0)
    p = world.table_probs(0, *setting)
    q = world.draft[0].softmax(-1)
    naive = naive_first_token(p, q, W)
    assert 0.5 * (naive - p).abs().sum() > 1e-3
    r, w, final = enumerate_rejection(world, tree, "sampled", setting)
    joint, want = emitted_joint(world, r, w, final, setting, 1)
    assert 0.5 * (joint - p).abs().sum() < 1e-12


# ------------------------------------------------------------------------------------------- Monte Carlo


def markov_world(V, seed):
    g = torch.Generator().manual_seed(seed)
    target = 2.0 * torch.randn(V, V, generator=g)  # logits of the next token given the last one
    return target, target + torch.randn(V, V, generator=g)


def run_mc(tree, N, V, setting, seed, chunk=25_000):
    """N speculative steps from root token 0 with i.i.d.-sampled drafts on a Markov target/draft."""
    target, draft = markov_world(V, seed)
    b, T = tree.buffers(), tree.num_nodes
    g = torch.Generator().manual_seed(seed + 1)
    firsts, seconds, lengths = [], [], []
    tp = expected_probs(target, *setting).float()  # [V, V]
    for start in range(0, N, chunk):
        n = min(chunk, N - start)
        toks = torch.zeros(n, T, dtype=torch.long)
        for i in range(1, T):
            toks[:, i] = torch.multinomial(draft[toks[:, tree.parents[i]]].softmax(-1), 1, generator=g).squeeze(1)
        q = draft[toks[:, torch.tensor(tree.parents).clamp(min=0)]].softmax(-1)
        u = torch.rand(n, T + 1, generator=g)
        r = accept_rejection(toks, target[toks], q, expand(b.children, n), u, *params(n, *setting, torch.float32),
                             max_depth=tree.max_depth)
        t1 = r.tokens[:, 0]
        # a step that emitted one token is continued by the target itself (the next step's first token)
        t2 = torch.where(r.num_accepted > 0, r.tokens[:, 1],
                         torch.multinomial(tp[t1], 1, generator=g).squeeze(1))
        firsts.append(t1), seconds.append(t2), lengths.append(r.num_accepted)
    return torch.cat(firsts), torch.cat(seconds), torch.cat(lengths), target, draft, tp


def tv_bound(p, N):
    # E|p_hat - p| <= sqrt(p (1 - p) / N) per token (Jensen), so E[TV] <= sum/2; allow twice that.
    return (p * (1 - p) / N).sqrt().sum().item()


def test_monte_carlo_tree_first_and_second_token_tv():
    V, N, setting = 64, 200_000, (0.9, 0, 0.95)
    tree = from_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]])  # depth 3, branching at two levels
    t1, t2, n, target, draft, tp = run_mc(tree, N, V, setting, seed=11)
    p1 = tp[0].double()
    p2 = (p1 @ tp.double())
    for got, want in ((t1, p1), (t2, p2)):
        emp = torch.bincount(got, minlength=V).double() / N
        tv = 0.5 * (emp - want).abs().sum().item()
        assert tv < min(tv_bound(want, N), 0.02), (tv, tv_bound(want, N))
    assert n.float().mean() > 0.5  # the tree is actually used


def test_monte_carlo_chain_accepted_lengths():
    V, N, k, setting = 64, 200_000, 3, (1.0, 0, 1.0)
    t1, _, n, target, draft, tp = run_mc(chain(k), N, V, setting, seed=5)
    tp = tp.double()
    qd = draft.softmax(-1).double()
    M = torch.minimum(tp, qd)  # M[x, y]: probability that y is drafted after x and accepted
    reach = [1.0]
    v = M[0]
    for _ in range(k):
        reach.append(v.sum().item())
        v = v @ M
    want = [reach[j] - (reach[j + 1] if j < k else 0.0) for j in range(k + 1)]
    got = torch.bincount(n, minlength=k + 1).double() / N
    for j in range(k + 1):
        assert abs(got[j].item() - want[j]) < 5 * math.sqrt(want[j] * (1 - want[j]) / N) + 1e-4, (j, got, want)
    emp = torch.bincount(t1, minlength=V).double() / N
    assert 0.5 * (emp - tp[0]).abs().sum().item() < tv_bound(tp[0], N)


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
    t = from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]])
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


def random_inputs(tree: TreeTemplate, B, V, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    T = tree.num_nodes
    tokens = torch.randint(0, V, (B, T), generator=g)
    logits = 3 * torch.randn(B, T, V, generator=g, dtype=dtype)
    # make some drafts right so the walks go deep
    tokens[:, 1:] = torch.where(torch.rand(B, T - 1, generator=g) < 0.6,
                                logits.argmax(-1)[:, list(tree.parents[1:])], tokens[:, 1:])
    q = torch.randn(B, T, V, generator=g, dtype=dtype).softmax(-1)
    u = torch.rand(B, T + 1, generator=g, dtype=dtype)
    temperature = torch.rand(B, generator=g, dtype=dtype) * 1.5
    temperature[0] = 0.0
    top_k = torch.randint(0, V, (B,), generator=g)
    top_p = 0.5 + 0.5 * torch.rand(B, generator=g, dtype=dtype)
    return tokens, logits, q, u, temperature, top_k, top_p


def run_all(tree, bufs, inputs, depth):
    tokens, logits, q, u, temperature, top_k, top_p = inputs
    return (accept_greedy(tokens, logits, bufs.paths),
            accept_typical(tokens, logits, bufs.paths, temperature, top_k, top_p),
            accept_rejection(tokens, logits, q, bufs.children, u, temperature, top_k, top_p, max_depth=depth))


def test_padded_rows_do_not_change_real_rows():
    tree, V, R, P = kary(2, 2), 16, 5, 7
    T = tree.num_nodes
    real = random_inputs(tree, R, V, seed=0)
    pad = list(random_inputs(tree, P, V, seed=1))
    pad[0] = torch.randint(-100, 100, (P, T))  # out-of-range tokens
    pad[1][0, 0] = float("nan")
    pad[1][1] = float("inf")
    pad[1][2, 3] = float("-inf")
    pad[2][3] = float("nan")
    g = torch.Generator().manual_seed(2)
    # padded rows may also carry another (valid) tree shape
    parents = torch.cat([torch.tensor([tree.parents] * R),
                         torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g))
                                                           for i in range(1, T)]) for _ in range(P)])])
    bufs = buffers_from_parents(parents, T - 1, T - 1)
    alone = run_all(tree, type(bufs)(*(x[:R] for x in bufs)), real, T - 1)
    mixed = run_all(tree, bufs, [torch.cat([a, b]) for a, b in zip(real, pad)], T - 1)
    for x, y in zip(alone, mixed):
        for a, b in zip(x, y):
            assert torch.equal(a, b[:R])


def test_acceptance_compiles_once_and_matches_eager():
    tree, B, V = kary(2, 2), 4, 16
    b = tree.buffers()
    bufs = type(b)(*(expand(x, B) if isinstance(x, torch.Tensor) else x for x in b))
    fns = {
        "greedy": lambda tk, lg, q, u, t, k, p: accept_greedy(tk, lg, bufs.paths),
        "typical": lambda tk, lg, q, u, t, k, p: accept_typical(tk, lg, bufs.paths, t, k, p),
        "rejection": lambda tk, lg, q, u, t, k, p: accept_rejection(
            tk, lg, q, bufs.children, u, t, k, p, max_depth=tree.max_depth, return_probs=True),
    }
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for name, fn in fns.items():
            compiled = torch.compile(fn, fullgraph=True, dynamic=False)
            for seed in (0, 1):
                inputs = random_inputs(tree, B, V, seed)
                want, got = fn(*inputs), compiled(*inputs)
                if name == "rejection":
                    (want, *want_p), (got, *got_p) = want, got
                    for x, y in zip(want_p, got_p):
                        torch.testing.assert_close(x, y)
                for x, y in zip(want, got):
                    assert torch.equal(x, y), name


@pytest.mark.parametrize("tree", ["chain3", "kary:2x2", "mc_sim_7b_63"])
def test_deterministic_candidates_without_q_equal_one_hot_q(tree):
    """draft_probs=None (what the runtime passes for deterministic proposals) is exactly one-hot q."""
    t = get_template(None if tree == "chain3" else tree, 3 if tree == "chain3" else (2 if tree.startswith("k") else 4))
    b, B, V = t.buffers(), 6, 11
    g = torch.Generator().manual_seed(5)
    toks = torch.randint(0, V, (B, t.num_nodes), generator=g)
    logits = torch.randn(B, t.num_nodes, V, generator=g, dtype=torch.float64)
    u = torch.rand(B, t.num_nodes + 1, generator=g, dtype=torch.float64)
    kw = dict(max_depth=t.max_depth, return_probs=True)
    one_hot = torch.nn.functional.one_hot(toks, V).double()
    sampling = params(B, 0.8, 3, 0.9)
    got = accept_rejection(toks, logits, None, expand(b.children, B), u, *sampling, **kw)
    want = accept_rejection(toks, logits, one_hot, expand(b.children, B), u, *sampling, **kw)
    for x, y in zip((*got[0], *got[1:]), (*want[0], *want[1:])):
        assert torch.equal(x, y)
