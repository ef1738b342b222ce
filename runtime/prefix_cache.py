"""Prefix caching: the KV of prompts' leading blocks, kept after their requests end, so that a prompt which
starts as an earlier one did (a shared system prompt, a chat's earlier turns, a repeated request) prefills
only the tokens past the longest cached run of blocks (vLLM's automatic prefix caching, SGLang's radix cache).

A block is `block` prompt tokens. Its key is its tokens and the id of the block before it, so a block is
found only after the very tokens it followed: keys are exact, and no hash can collide. At least a prompt's
last token is always prefilled, since its logits pick the first token.

Loading a block in place of prefilling it is exact only where graphs are row-independent (each token's K/V
is bitwise what it is whatever chunk computed it), which the engine checks before it keeps a cache. Blocks
are evicted least recently used first within a byte budget; a lookup refreshes a prompt's blocks from its
last to its first, so a block is always fresher than the blocks after it and eviction takes leaves first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from torch import Tensor

from specair.runtime.kv_slots import KVSlots

DEFAULT_PREFIX_CACHE_BYTES = 256 << 20


@dataclass
class _Block:
    id: int
    kv: dict[str, tuple[Tensor, Tensor]]  # role -> (k, v) [L, Hkv, block, D]
    nbytes: int


class PrefixCache:
    """Blocks of prompt KV by exact token prefix, least recently used evicted past `budget` bytes."""

    def __init__(self, block: int, budget: int = DEFAULT_PREFIX_CACHE_BYTES) -> None:
        if block < 1 or budget < 0:
            raise ValueError(f"a prefix cache needs a positive block and a budget >= 0, got {block} and {budget}")
        self.block, self.budget = block, budget
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], _Block] = OrderedDict()
        self._next_id = 1  # 0 is the empty prefix every first block follows
        self.bytes = 0

    def _key(self, prompt: Sequence[int], i: int, parent: int) -> tuple[int, tuple[int, ...]]:
        return parent, tuple(prompt[i * self.block:(i + 1) * self.block])

    def load(self, prompt: Sequence[int], kv: KVSlots) -> int:
        """Write the longest cached run of the prompt's blocks (at most all but its last token) into the prefill
        scratch; returns how many prompt tokens it covers."""
        found, parent = [], 0
        for i in range((len(prompt) - 1) // self.block):
            key = self._key(prompt, i, parent)
            b = self._blocks.get(key)
            if b is None:
                break
            kv.write_scratch(i * self.block, b.kv)
            found.append(key)
            parent = b.id
        for key in reversed(found):
            self._blocks.move_to_end(key)
        return len(found) * self.block

    def store(self, prompt: Sequence[int], kv: KVSlots) -> None:
        """Keep the prompt's full blocks that are not cached yet, read from the prefill scratch (which holds the
        whole prompt), then evict past the budget."""
        path, parent = [], 0
        for i in range(len(prompt) // self.block):
            key = self._key(prompt, i, parent)
            b = self._blocks.get(key)
            if b is None:
                blocks = kv.read_scratch(i * self.block, (i + 1) * self.block)
                nbytes = sum(t.numel() * t.element_size() for pair in blocks.values() for t in pair)
                if nbytes > self.budget:
                    break
                b = self._blocks[key] = _Block(self._next_id, blocks, nbytes)
                self._next_id += 1
                self.bytes += nbytes
            path.append(key)
            parent = b.id
        for key in reversed(path):
            self._blocks.move_to_end(key)
        while self.bytes > self.budget:
            _, b = self._blocks.popitem(last=False)
            self.bytes -= b.nbytes

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        self._blocks.clear()
        self.bytes = 0
