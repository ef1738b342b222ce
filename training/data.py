"""Batches of distilled sequences, and the reduced draft vocabulary chosen from them."""

from __future__ import annotations

import random
from dataclasses import dataclass
from collections.abc import Sequence

import torch
from torch import Tensor

from specair.models.errors import InputError
from specair.training.distill import DistilledSequence


@dataclass
class Batch:
    """Right-padded sequences: padding sits after every real token, so causal attention never reads it."""

    tokens: Tensor  # [B, T] int64 (0 in padding)
    hidden: Tensor  # [B, T, H] float32 target hidden states (zeros in padding); empty when not loaded
    lengths: Tensor  # [B] real tokens per row
    prompt_lens: Tensor  # [B] prompt tokens per row (answer tokens follow)
    features: Tensor | None = None  # [B, T, n*H] float32 target layer features (EAGLE-3's input), when asked for

    def target_mask(self, first: int = 0) -> Tensor:
        """[B, T] True where index t is a real answer token, t >= first: the tokens a draft is scored on."""
        t = torch.arange(self.tokens.shape[1])
        return (t >= self.prompt_lens.unsqueeze(1)) & (t < self.lengths.unsqueeze(1)) & (t >= first)


def collate(seqs: Sequence[DistilledSequence], with_hidden: bool = True, with_features: bool = False) -> Batch:
    """Pad sequences into one Batch (hidden states and features upcast to float32)."""
    B, T = len(seqs), max(int(s.tokens.numel()) for s in seqs)
    tokens = torch.zeros(B, T, dtype=torch.long)
    H = seqs[0].hidden.shape[-1] if with_hidden else 0
    hidden = torch.zeros(B, T, H) if with_hidden else torch.zeros(0)
    features = torch.zeros(B, T, seqs[0].features.shape[-1]) if with_features else None
    for i, s in enumerate(seqs):
        n = s.tokens.numel()
        tokens[i, :n] = s.tokens
        if with_hidden:
            hidden[i, :n] = s.hidden.float()
        if features is not None:
            features[i, :n] = s.features.float()
    return Batch(tokens, hidden, torch.tensor([s.tokens.numel() for s in seqs]),
                 torch.tensor([s.prompt_len for s in seqs]), features)


def length_grouped_batches(lengths: Sequence[int], batch_size: int, seed: int) -> list[list[int]]:
    """Indices in batches of `batch_size`, shuffled by `seed`, with similar lengths grouped (in windows of
    16 batches) so padding stays small; the batch order is shuffled again."""
    if batch_size < 1:
        raise InputError(f"batch size must be positive, got {batch_size}")
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = 16 * batch_size
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w:w + window], key=lambda i: lengths[i])
        batches += [chunk[b:b + batch_size] for b in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def token_counts(seqs: Sequence[DistilledSequence], vocab_size: int) -> Tensor:
    """How often each token id occurs in the answers [vocab_size] (answer tokens are what a draft proposes)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s.tokens[s.prompt_len:], minlength=vocab_size)
    return counts


def build_draft_vocab(seqs: Sequence[DistilledSequence], vocab_size: int, size: int,
                      always: Sequence[int] = ()) -> Tensor:
    """The `size` most frequent answer tokens (ties broken by lower id), plus the ids in `always` (e.g. EOS),
    sorted ascending. A size >= vocab_size returns None-equivalent: every id."""
    if size < 1:
        raise InputError(f"--draft-vocab must be positive (0 means the full vocabulary), got {size}")
    size = min(size, vocab_size)
    counts = token_counts(seqs, vocab_size)
    # Stable descending order by count: ties keep the lower id first.
    order = torch.sort(counts, descending=True, stable=True).indices
    must = [t for t in dict.fromkeys(always) if 0 <= t < vocab_size]
    rest = [t for t in order.tolist() if t not in set(must)][: max(size - len(must), 0)]
    return torch.tensor(sorted(must + rest), dtype=torch.long)


def vocab_coverage(seqs: Sequence[DistilledSequence], ids: Tensor | None, vocab_size: int) -> float:
    """Fraction of answer tokens inside the draft vocabulary `ids` (1.0 for the full vocabulary)."""
    if ids is None:
        return 1.0
    counts = token_counts(seqs, vocab_size)
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 1.0
