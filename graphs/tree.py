"""Token-tree templates and their static index buffers.

A tree of T nodes: node 0 is the root, the last accepted token (its K/V is not cached yet; verify
recomputes it). Nodes are in BFS order (sorted by depth), parents[i] < i, and siblings are ordered
by rank (rank r = the r-th best candidate of the parent's draft distribution). A chain of k draft
tokens is the tree with T = k + 1 and one child per node.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
from torch import Tensor


class TreeBuffers(NamedTuple):
    """Index buffers of a static tree (CPU, long/bool); expand them to [B, ...] per batch row."""

    parents: Tensor  # [T], -1 at the root
    depth: Tensor  # [T], root 0
    ranks: Tensor  # [T]
    ancestor_mask: Tensor  # [T, T] bool: [i, j] iff j is i or an ancestor of i
    children: Tensor  # [T, W] child ids ordered by rank, -1 padded
    paths: Tensor  # [T, D+1] root-to-node path of every node (root first), -1 padded
    levels: tuple[Tensor, ...]  # levels[d] = node ids at depth d, d = 0..D


class DynamicTreeBuffers(NamedTuple):
    """Per-row index buffers of trees whose shape differs per batch row (EAGLE-2 style)."""

    depth: Tensor  # [B, T]
    ancestor_mask: Tensor  # [B, T, T] bool
    children: Tensor  # [B, T, W] ordered by node index, -1 padded
    paths: Tensor  # [B, T, D+1], -1 padded


@dataclass(frozen=True)
class TreeTemplate:
    """A static token tree: parents[i] < i (parents[0] == -1), BFS order, siblings ordered by rank."""

    name: str
    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        p, r = self.parents, self.ranks
        if not p or p[0] != -1 or len(r) != len(p) or r[0] != 0:
            raise ValueError(f"tree {self.name!r}: need parents[0] == -1, ranks[0] == 0 and equal lengths")
        if any(not 0 <= p[i] < i for i in range(1, len(p))):
            raise ValueError(f"tree {self.name!r}: need 0 <= parents[i] < i for every non-root node")
        depth = _depths(p)
        if any(depth[i] < depth[i - 1] for i in range(1, len(p))):
            raise ValueError(f"tree {self.name!r}: nodes must be in BFS order (sorted by depth)")
        last_rank: dict[int, int] = {}
        for i in range(1, len(p)):
            if r[i] < 0 or r[i] <= last_rank.get(p[i], -1):
                raise ValueError(f"tree {self.name!r}: siblings must be ordered by strictly increasing rank >= 0")
            last_rank[p[i]] = r[i]

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(_depths(self.parents))

    @property
    def max_width(self) -> int:
        counts = [0] * len(self.parents)
        for q in self.parents[1:]:
            counts[q] += 1
        return max(counts)

    def buffers(self) -> TreeBuffers:
        """The tree's index buffers (built once per tree shape, then cached)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        if torch.compiler.is_dynamo_compiling():  # Dynamo treats the cached buffers as constants
            return _build_buffers(self.parents, self.ranks)
        # A first call under (non-strict) torch.export tracing would otherwise cache fake tensors for everyone,
        # and one under inference_mode inference tensors that autograd (head training) cannot save.
        with unset_fake_temporarily(), torch.inference_mode(False):
            return _build_buffers(self.parents, self.ranks)


def _depths(parents: Sequence[int]) -> list[int]:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


@functools.lru_cache(maxsize=None)
def _build_buffers(parents: tuple[int, ...], ranks: tuple[int, ...]) -> TreeBuffers:
    # Plain Python on purpose: it is built once, and it is the reference buffers_from_parents is tested against.
    T = len(parents)
    depth = _depths(parents)
    D = max(depth)
    kids: list[list[int]] = [[] for _ in range(T)]
    for i in range(1, T):
        kids[parents[i]].append(i)  # BFS order + rank-ordered siblings => ordered by rank
    W = max(len(k) for k in kids)
    paths = []
    for i in range(T):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1] + [-1] * (D + 1 - len(path)))
    anc = torch.zeros(T, T, dtype=torch.bool)
    for i, path in enumerate(paths):
        anc[i, [j for j in path if j >= 0]] = True
    return TreeBuffers(
        parents=torch.tensor(parents, dtype=torch.long),
        depth=torch.tensor(depth, dtype=torch.long),
        ranks=torch.tensor(ranks, dtype=torch.long),
        ancestor_mask=anc,
        children=torch.tensor([k + [-1] * (W - len(k)) for k in kids], dtype=torch.long).view(T, W),
        paths=torch.tensor(paths, dtype=torch.long),
        levels=tuple(torch.tensor([i for i in range(T) if depth[i] == d], dtype=torch.long) for d in range(D + 1)),
    )


def from_choices(choices: Sequence[Sequence[int]], name: str = "custom") -> TreeTemplate:
    """A tree from a Medusa choice list: each choice is the path of top-k ranks from the (implicit) root.

    Every prefix of a choice must be present. Nodes are ordered by (depth, choice), as Medusa does.
    """
    paths = [tuple(int(x) for x in c) for c in choices]
    if any(len(c) == 0 or min(c) < 0 for c in paths):
        raise ValueError(f"tree {name!r}: every choice must be a non-empty list of ranks >= 0")
    if len(set(paths)) != len(paths):
        raise ValueError(f"tree {name!r}: duplicate choices")
    present = set(paths)
    for c in paths:
        if len(c) > 1 and c[:-1] not in present:
            raise ValueError(f"tree {name!r}: choice {list(c)} lacks its prefix {list(c[:-1])}")
    order = sorted(paths, key=lambda c: (len(c), c))
    index = {c: i + 1 for i, c in enumerate(order)}
    parents = (-1,) + tuple(index[c[:-1]] if len(c) > 1 else 0 for c in order)
    ranks = (0,) + tuple(c[-1] for c in order)
    return TreeTemplate(name, parents, ranks)


def chain(k: int) -> TreeTemplate:
    """k draft tokens in a row (T = k + 1)."""
    if k < 0:
        raise ValueError(f"chain length must be >= 0, got {k}")
    return TreeTemplate(f"chain:{k}", tuple(range(-1, k)), (0,) * (k + 1))


def kary(depth: int, width: int) -> TreeTemplate:
    """The full width-ary tree of the given depth (T = 1 + width + ... + width**depth)."""
    if depth < 1 or width < 1:
        raise ValueError(f"kary needs depth >= 1 and width >= 1, got {depth}x{width}")
    level: list[list[int]] = [[]]
    choices: list[list[int]] = []
    for _ in range(depth):
        level = [c + [r] for c in level for r in range(width)]
        choices += level
    return from_choices(choices, name=f"kary:{depth}x{width}")


# Medusa's default tree, copied verbatim from FasterDecoding/Medusa medusa/model/medusa_choices.py
# (commit 11af0aa503437b40d45f5a47c001c43699b7ae52): 63 nodes + root, 10/28/23/2 nodes at depths 1-4.
MC_SIM_7B_63: list[list[int]] = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0],
    [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0],
    [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4],
    [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8],
    [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0],
    [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
]

_FORMS = '"chain" or None (k tokens), "chain:K", "kary:DxW" (e.g. "kary:3x2"), "mc_sim_7b_63", or a Medusa choice list'


def get_template(spec: str | Sequence[Sequence[int]] | TreeTemplate | None, k: int) -> TreeTemplate:
    """The tree for a user setting: None or "chain" -> chain(k); "chain:K"; "kary:DxW"; "mc_sim_7b_63"; choices."""
    if isinstance(spec, TreeTemplate):
        return spec
    if spec is None:
        return chain(k)
    if isinstance(spec, str):
        s = spec.strip().lower()
        if s == "chain":
            return chain(k)
        if s == "mc_sim_7b_63":
            return from_choices(MC_SIM_7B_63, name="mc_sim_7b_63")
        if m := re.fullmatch(r"chain:(\d+)", s):
            return chain(int(m[1]))
        if m := re.fullmatch(r"kary:(\d+)x(\d+)", s):
            return kary(int(m[1]), int(m[2]))
        raise ValueError(f"unknown tree {spec!r}; accepted: {_FORMS}")
    try:
        return from_choices(spec)
    except TypeError as e:
        raise ValueError(f"unknown tree {spec!r}; accepted: {_FORMS}") from e


def buffers_from_parents(parents: Tensor, max_depth: int, max_width: int) -> DynamicTreeBuffers:
    """Per-row buffers of dynamic trees: parents [B, T] (parents[:, 0] = -1, parents[b, i] < i).

    Graph-safe: loops only over the static max_depth. Trees deeper than max_depth get truncated
    ancestor masks, and a node's children beyond max_width are dropped: size both for the worst case.
    Children are ordered by node index (= by rank when siblings are emitted in rank order).
    """
    B, T = parents.shape
    ids = torch.arange(T, device=parents.device)
    up = parents.clamp(min=0)  # the root is its own parent, so climbing saturates there
    anc = (ids[:, None] == ids).expand(B, T, T)
    node = ids.expand(B, T)
    for _ in range(max_depth):
        node = up.gather(1, node)
        anc = anc | (node[:, :, None] == ids)
    depth = anc.sum(-1) - 1
    levels = torch.arange(max_depth + 1, device=parents.device)
    # paths[b, i, d] = the ancestor of i at depth d: the one j with anc[b, i, j] and depth[b, j] == d.
    at = anc[..., None] & (depth[:, None, :, None] == levels)  # [B, T, T, D+1]
    paths = torch.where(at.any(2), (at * ids[:, None]).sum(2), -1)
    # children[b, i, w] = the w-th child of i: the j with parents[b, j] == i and w earlier siblings.
    is_child = parents[:, None, :] == ids[:, None]  # [B, T(i), T(j)]
    slot = is_child.cumsum(-1) - 1
    sel = is_child[..., None] & (slot[..., None] == torch.arange(max_width, device=parents.device))
    children = torch.where(sel.any(2), (sel * ids[:, None]).sum(2), -1)
    return DynamicTreeBuffers(depth, anc, children, paths)
