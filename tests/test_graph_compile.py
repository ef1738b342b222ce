"""Every graph of a speculative step compiles with torch.compile(fullgraph=True, dynamic=False) with
recompiles fatal (no graph breaks, no host syncs), matches eager, leaves the caches untouched (graphs
are pure; only the commits write), and keeps padded rows inert."""

import functools

import pytest
import torch
import torch._dynamo
from helpers import save_tiny

from specair.graphs.draft import draft_static_tree, draft_topk_tree
from specair.graphs.kv import commit_kv
from specair.graphs.steps import decode_step, prefill_chunk
from specair.graphs.tree import buffers_from_parents, get_template
from specair.graphs.verify import expanded_verify, leaf_paths, tree_verify, verify_and_accept
from specair.models.checkpoint import load_checkpoint
from specair.models.llama import build_model

B, SLOTS, CTX = 2, 192, 128


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny("llama", path)
    ckpt = load_checkpoint(path, progress=False)
    return build_model(ckpt.config, ckpt.state_dict)


@pytest.fixture(autouse=True)
def strict_dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def filled_cache(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = model.empty_cache(B, SLOTS)
    return k.normal_(generator=g), v.normal_(generator=g)


def clone(x):
    return tuple(t.clone() for t in x)


def assert_same(a, b, atol=1e-4):
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    for x, y in zip(a, b):
        if x is None:
            assert y is None
        elif x.is_floating_point():
            assert torch.allclose(x, y, atol=atol, rtol=1e-4)
        else:
            assert torch.equal(x, y)


def run_both(fn, caches, args):
    """Run fn eagerly and compiled (twice, new data: must not recompile) on copies of the caches."""
    outs = []
    torch._dynamo.reset()  # compiled partials share one wrapper frame; count recompiles per graph
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    for f in (fn, compiled):
        kv = clone(caches)
        outs.append((f(*args(kv)), kv))
    kv = clone(caches)
    compiled(*args(kv))  # same shapes, new buffers: no recompile allowed
    assert_same(outs[0][0], outs[1][0])
    assert_same(outs[0][1], outs[1][1])
    if fn is not commit_kv:
        assert_same(outs[0][1], caches)
    return outs[0]


SAMPLING = (torch.tensor([0.0, 0.8]), torch.tensor([0, 20]), torch.tensor([1.0, 0.9]))


def test_prefill_and_decode_compile(model):
    caches = filled_cache(model)
    tokens = torch.randint(0, 256, (B, 16))
    run_both(functools.partial(prefill_chunk, model, ctx=CTX), caches,
             lambda kv: (tokens, torch.tensor([5, 40]), torch.tensor([16, 9]), *kv))
    run_both(functools.partial(decode_step, model, ctx=CTX), caches,
             lambda kv: (tokens[:, 0], torch.tensor([5, 40]), *kv, *SAMPLING, torch.tensor([0.3, 0.6])))


# A static tree; the larger static trees (mc_sim_7b_63) are the same graph code at another size, compared
# with eager in test_speculative.py. A chain's draft and verify graphs compile under the same rules
# (fullgraph, no recompiles) in test_compile.py's inductor-chain generation.
def test_draft_and_verify_compile(model):
    tpl = get_template("kary:2x2", 3)
    D = tpl.max_depth
    caches = filled_cache(model)
    catch = torch.randint(0, 256, (B, D + 1))
    n_catch, draft_len = torch.tensor([2, D + 1]), torch.tensor([10, 50])
    fn = functools.partial(draft_static_tree, model, template=tpl, ctx=CTX)
    drafted, _ = run_both(fn, caches, lambda kv: (catch, n_catch, draft_len, *kv))
    tokens, ck = drafted[0], drafted[-2]
    assert ck.shape[3] == D + 1
    assert tokens.shape == (B, tpl.num_nodes) and len(drafted) == 3

    buf = tpl.buffers()
    root = torch.tensor([12, 60])
    out, _ = run_both(functools.partial(tree_verify, model, ctx=CTX), caches,
                      lambda kv: (tokens, buf.depth, buf.ancestor_mask.unsqueeze(0), root, *kv))
    exp, _ = run_both(functools.partial(expanded_verify, model, ctx=CTX), caches,
                      lambda kv: (tokens, *leaf_paths(buf.paths, buf.children), root, *kv))
    for a, b in zip(out, exp):  # both scorers agree node by node
        assert torch.allclose(a, b, atol=1e-4)
    # Scoring and acceptance in one graph, with either scorer, then the accepted path's commit.
    u = torch.rand(B, D + 1)
    static = dict(ctx=CTX, acceptance="exact", max_depth=D, max_width=tpl.max_width, tree=buf)
    fused, _ = run_both(functools.partial(verify_and_accept, model, **static), caches,
                        lambda kv: (tokens, root, *kv, None, u, *SAMPLING))
    fused_exp = verify_and_accept(model, tokens, root, *caches, None, u, *SAMPLING,
                                  expansion=leaf_paths(buf.paths, buf.children), **static)
    assert_same(fused, fused_exp)
    num_accepted, _, node_ids, path_hidden, path_k, _ = fused
    assert path_k.shape[3] == D + 1 and path_hidden.shape == (B, D + 1, 64)
    for b in range(B):  # the path's K/V and hidden states are the verify pass's, node by node
        for j in range(int(num_accepted[b]) + 1):
            assert torch.allclose(path_k[:, b, :, j], out.new_k[:, b, :, node_ids[b, j]], atol=1e-5)
            assert torch.allclose(path_hidden[b, j], out.hidden[b, node_ids[b, j]], atol=1e-5)
    slots = root.unsqueeze(1) + torch.arange(D + 1)
    run_both(commit_kv, caches, lambda kv: (*kv, path_k, fused[5], slots))


def test_topk_tree_draft_and_dynamic_buffers_compile(model):
    caches = filled_cache(model)
    catch = torch.randint(0, 256, (B, 5))
    fn = functools.partial(draft_topk_tree, model, depth=4, topk=3, num_nodes=12, ctx=CTX)
    (tokens, parents, _, _), _ = run_both(fn, caches,
                                          lambda kv: (catch, torch.tensor([1, 5]), torch.tensor([9, 30]), *kv))
    assert tokens.shape == parents.shape == (B, 13) and (parents[:, 1:] < torch.arange(1, 13)).all()
    torch._dynamo.reset()
    compiled = torch.compile(functools.partial(buffers_from_parents, max_depth=4, max_width=3), fullgraph=True)
    assert_same(tuple(compiled(parents)), tuple(buffers_from_parents(parents, 4, 3)))
    # The fused verify graph builds the per-row tree buffers from the parents inside itself.
    fused = functools.partial(verify_and_accept, model, ctx=CTX, acceptance="greedy", max_depth=4, max_width=3)
    run_both(fused, caches, lambda kv: (tokens, torch.tensor([12, 60]), *kv, parents))


def test_padded_rows_do_not_change_real_rows(model):
    """Row 0 alone vs row 0 next to a padding row with garbage tokens, lengths and cache."""
    tpl = get_template("kary:2x2", 2)
    buf = tpl.buffers()
    k, v = filled_cache(model)
    tokens = torch.randint(0, 256, (B, tpl.num_nodes))
    root = torch.tensor([30, 0])
    both = tree_verify(model, tokens, buf.depth, buf.ancestor_mask.unsqueeze(0), root, k, v, CTX)
    alone = tree_verify(model, tokens[:1], buf.depth, buf.ancestor_mask.unsqueeze(0), root[:1], k[:, :1], v[:, :1], CTX)
    assert torch.allclose(both.logits[:1], alone.logits, atol=1e-6)
    assert torch.allclose(both.new_k[:, :1], alone.new_k, atol=1e-6)
