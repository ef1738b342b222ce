"""Tree templates and their index buffers (static and per-row dynamic)."""

import pytest
import torch

from specair.graphs.tree import (
    MC_SIM_7B_63,
    TreeTemplate,
    buffers_from_parents,
    chain,
    from_choices,
    get_template,
    kary,
)


def test_chain3_buffers():
    t = chain(3)
    b = t.buffers()
    assert (t.num_nodes, t.max_depth, t.max_width) == (4, 3, 1)
    assert b.parents.tolist() == [-1, 0, 1, 2]
    assert b.depth.tolist() == [0, 1, 2, 3]
    assert b.ranks.tolist() == [0, 0, 0, 0]
    assert torch.equal(b.ancestor_mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert b.children.tolist() == [[1], [2], [3], [-1]]
    assert b.paths.tolist() == [[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, -1], [0, 1, 2, 3]]
    assert [lv.tolist() for lv in b.levels] == [[0], [1], [2], [3]]
    assert t.buffers() is b  # cached


def test_kary_2x2_buffers():
    t = kary(2, 2)
    b = t.buffers()
    assert (t.num_nodes, t.max_depth, t.max_width) == (7, 2, 2)
    assert b.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert b.ranks.tolist() == [0, 0, 1, 0, 1, 0, 1]
    assert b.children.tolist() == [[1, 2], [3, 4], [5, 6], [-1, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert b.paths.tolist() == [[0, -1, -1], [0, 1, -1], [0, 2, -1], [0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 2, 6]]
    assert b.ancestor_mask[4].tolist() == [True, True, False, False, True, False, False]
    assert b.ancestor_mask[5].tolist() == [True, False, True, False, False, True, False]
    assert [lv.tolist() for lv in b.levels] == [[0], [1, 2], [3, 4, 5, 6]]


def test_from_choices_orders_by_depth_then_choice():
    t = from_choices([[1], [0, 0], [0], [2], [0, 1], [1, 0], [0, 0, 0]])
    b = t.buffers()
    # Sorted: [0] [1] [2] [0,0] [0,1] [1,0] [0,0,0] -> nodes 1..7.
    assert list(t.parents) == [-1, 0, 0, 0, 1, 1, 2, 4]
    assert list(t.ranks) == [0, 0, 1, 2, 0, 1, 0, 0]
    assert b.children.tolist() == [[1, 2, 3], [4, 5, -1], [6, -1, -1], [-1] * 3, [7, -1, -1], [-1] * 3, [-1] * 3,
                                   [-1] * 3]
    assert b.paths[7].tolist() == [0, 1, 4, 7]
    assert b.depth.tolist() == [0, 1, 1, 1, 2, 2, 2, 3]


def test_choices_with_gaps_in_ranks():
    t = from_choices([[0], [3], [3, 2]])
    assert list(t.parents) == [-1, 0, 0, 2] and list(t.ranks) == [0, 0, 3, 2]


@pytest.mark.parametrize("bad", [[[0, 0]], [[0], [0]], [[]], [[0], [-1]]])
def test_from_choices_rejects_bad_lists(bad):
    with pytest.raises(ValueError):
        from_choices(bad)


def test_template_validation():
    with pytest.raises(ValueError):
        TreeTemplate("x", (-1, 0, 2), (0, 0, 0))  # parent not before the node
    with pytest.raises(ValueError):
        TreeTemplate("x", (-1, 0, 1, 0), (0, 0, 0, 1))  # not BFS
    with pytest.raises(ValueError):
        TreeTemplate("x", (-1, 0, 0), (0, 1, 0))  # siblings out of rank order


def test_mc_sim_7b_63_structure():
    assert len(MC_SIM_7B_63) == 63
    t = get_template("mc_sim_7b_63", k=5)
    b = t.buffers()
    assert (t.num_nodes, t.max_depth, t.max_width) == (64, 4, 10)
    assert [len(lv) for lv in b.levels] == [1, 10, 28, 23, 2]
    assert torch.equal(b.ancestor_mask.sum(-1), b.depth + 1)
    assert torch.equal(b.ancestor_mask[:, 0], torch.ones(64, dtype=torch.bool))
    # Each node's path, read as ranks, is the Medusa choice it came from, in Medusa's (len, value) order.
    order = sorted(MC_SIM_7B_63, key=lambda c: (len(c), c))
    for i, choice in enumerate(order, start=1):
        path = [n for n in b.paths[i].tolist() if n >= 0]
        assert [t.ranks[n] for n in path[1:]] == choice
        assert path[-1] == i and t.parents[i] == path[-2]
    # children and parents agree
    for i in range(64):
        kids = [c for c in b.children[i].tolist() if c >= 0]
        assert kids == [j for j in range(64) if t.parents[j] == i]


def test_get_template_forms():
    assert get_template(None, 4) == chain(4)
    assert get_template("chain", 2) == chain(2)
    assert get_template("chain:3", 7) == chain(3)
    assert get_template("kary:3x2", 1) == kary(3, 2)
    assert kary(3, 2).num_nodes == 15
    assert get_template([[0], [1], [0, 0]], 1).num_nodes == 4
    with pytest.raises(ValueError, match="kary:DxW"):
        get_template("eagle-tree", 3)
    with pytest.raises(ValueError):
        get_template([[0, 1]], 3)


@pytest.mark.parametrize("template", [chain(3), kary(2, 2), kary(3, 2), get_template("mc_sim_7b_63", 0)],
                         ids=lambda t: t.name)
def test_buffers_from_parents_matches_static(template):
    b = template.buffers()
    B = 3
    d = buffers_from_parents(b.parents.expand(B, -1), template.max_depth, template.max_width)
    for name in d._fields:
        want = getattr(b, name)
        assert torch.equal(getattr(d, name), want.expand(B, *want.shape)), name


def test_buffers_from_parents_rows_with_different_shapes():
    a = from_choices([[0], [1], [0, 0], [0, 1], [1, 0]])  # T = 6, depth 2
    c = chain(5)  # T = 6, depth 5
    parents = torch.tensor([a.parents, c.parents])
    d = buffers_from_parents(parents, max_depth=5, max_width=2)
    for r, t in enumerate((a, c)):
        b = t.buffers()
        assert torch.equal(d.depth[r], b.depth)
        assert torch.equal(d.ancestor_mask[r], b.ancestor_mask)
        W, Dp1 = b.children.shape[1], b.paths.shape[1]
        assert torch.equal(d.children[r, :, :W], b.children) and (d.children[r, :, W:] == -1).all()
        assert torch.equal(d.paths[r, :, :Dp1], b.paths) and (d.paths[r, :, Dp1:] == -1).all()


def test_buffers_from_parents_compiles_without_recompiles():
    fn = torch.compile(buffers_from_parents, fullgraph=True, dynamic=False)
    p1 = torch.tensor([[-1, 0, 0, 1, 2, 2], [-1, 0, 1, 2, 3, 4]])
    p2 = torch.tensor([[-1, 0, 0, 0, 1, 1], [-1, 0, 1, 1, 0, 2]])
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for p in (p1, p2):
            got, want = fn(p, 5, 3), buffers_from_parents(p, 5, 3)
            for g, w in zip(got, want):
                assert torch.equal(g, w)
