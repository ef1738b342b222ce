"""Medusa head training on cached target hidden states.

Head i reads the target's hidden state h_p (after its final norm) and predicts x_{p+2+i}; the loss is
the cross-entropy against the distilled (greedy) tokens, weighted `head_decay ** i` as in Medusa-1. The
heads' output is the target's LM head, tied and frozen (optionally restricted to a draft vocabulary), so
only the ResBlocks train: they start at the identity and a shipped file holds only them.

A head sees one hidden state and nothing else, so training samples are single positions, drawn from all
training sequences at once.
"""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specair.models.medusa import WEIGHTS_NAME, MedusaHeads, load_medusa, save_medusa
from specair.training.acceptance import AcceptanceCounter, true_token_rank
from specair.training.distill import DistilledSequence
from specair.training.setup import TrainingSetup, cast_safetensors, write_training_json
from specair.training.trainer import TrainConfig, Trainer


@dataclass
class MedusaSettings:
    """What the Medusa recipe adds to the shared optimisation settings."""

    num_heads: int = 4
    num_layers: int = 1
    draft_vocab: int = 8192  # 0: the full vocabulary
    head_decay: float = 0.8  # loss weight of head i is head_decay ** i


def flatten_positions(seqs: list[DistilledSequence], num_heads: int,
                      to_index: Tensor | None) -> tuple[Tensor, Tensor]:
    """All positions p whose head-0 target x_{p+2} is an answer token: hidden states [n, H] (float16) and
    per-head target indices [n, num_heads] (-1 where x_{p+2+i} is past the end, in the prompt, or outside
    the draft vocabulary)."""
    hs, ts = [], []
    for s in seqs:
        L, P = int(s.tokens.numel()), s.prompt_len
        first, last = max(P - 2, 0), L - 3  # p with P <= p + 2 <= L - 1
        if last < first:
            continue
        p = torch.arange(first, last + 1)
        idx = p.unsqueeze(1) + 2 + torch.arange(num_heads)  # [n, heads]
        ok = (idx < L) & (idx >= P)
        tok = s.tokens[idx.clamp(max=L - 1)]
        if to_index is not None:
            tok = to_index[tok]
        ts.append(torch.where(ok, tok, torch.full_like(tok, -1)))
        hs.append(s.hidden[p])
    H = seqs[0].hidden.shape[-1] if seqs else 0
    if not hs:
        return torch.zeros(0, H, dtype=torch.float16), torch.zeros(0, num_heads, dtype=torch.long)
    return torch.cat(hs), torch.cat(ts)


class MedusaRecipe:
    """Trains tied MedusaHeads over a frozen target from a TrainingSetup."""

    def __init__(self, setup: TrainingSetup, settings: MedusaSettings) -> None:
        self.setup, self.s = setup, settings
        self.vocab = setup.draft_vocab(settings.draft_vocab)
        self.heads = MedusaHeads(setup.target, settings.num_heads, settings.num_layers, draft_vocab=self.vocab)
        self.params = {"res_weight": self.heads.res_weight, "res_bias": self.heads.res_bias}
        for p in self.params.values():
            p.requires_grad_(True)
        V = setup.target.config.vocab_size
        self.to_index = None
        if self.vocab is not None:
            self.to_index = torch.full((V,), -1, dtype=torch.long)
            self.to_index[self.vocab] = torch.arange(self.vocab.numel())
        self.weights = torch.tensor([settings.head_decay ** i for i in range(settings.num_heads)])

    def losses(self, hidden: Tensor, targets: Tensor) -> tuple[Tensor, dict]:
        """hidden [n, H], targets [n, heads] (-1 ignored) -> weighted CE and per-head top-1 accuracy."""
        logits = self.heads.logits(self.heads.features(hidden.float()), reduced=True).float()  # [n, heads, Vd]
        total = logits.new_zeros(())
        metrics = {}
        for i in range(self.s.num_heads):
            t = targets[:, i]
            ok = t >= 0
            if not ok.any():
                continue
            ce = F.cross_entropy(logits[ok, i], t[ok])
            total = total + self.weights[i] * ce
            metrics[f"acc{i}"] = float((logits[ok, i].detach().argmax(-1) == t[ok]).float().mean())
        return total / self.weights.sum(), metrics

    def train_step(self, indices: Tensor, step: int) -> dict:
        loss, metrics = self.losses(self._h[indices], self._t[indices])
        return {"loss": loss, **{k: v for k, v in metrics.items() if k in ("acc0", f"acc{self.s.num_heads - 1}")}}

    @torch.no_grad()
    def evaluate(self, chunk: int = 2048) -> dict:
        """Held-out loss and offline acceptance of the heads' greedy chain (head i = depth i+1)."""
        depth = self.s.num_heads
        counter = AcceptanceCounter(depth)
        losses, n = 0.0, 0
        for b in range(0, self._eh.shape[0], chunk):
            h, t = self._eh[b:b + chunk], self._et[b:b + chunk]
            loss, _ = self.losses(h, t)
            losses += float(loss) * h.shape[0]
            n += h.shape[0]
            logits = self.heads.logits(self.heads.features(h.float()), reduced=True)
            ranks = true_token_rank(logits, t)  # [n, heads]
            complete = self._ecomplete[b:b + chunk]
            counter.add(ranks[complete])
        return {"heldout_loss": round(losses / max(n, 1), 5), "acceptance": counter.result()}

    def fit(self, cfg: TrainConfig, out: Path, resume: bool, keep_checkpoint: bool = False) -> dict:
        """Train, then write the heads (fp16, FasterDecoding layout, tied) and training.json to `out`."""
        self._h, self._t = flatten_positions(self.setup.train, self.s.num_heads, self.to_index)
        self._eh, self._et = self._heldout_positions()
        n = self._h.shape[0]
        steps_per_epoch = -(-n // cfg.batch_size)
        trainer = Trainer(self.params, cfg, out / "checkpoint", steps_per_epoch, desc="medusa")
        if resume and trainer.load_latest():
            print(f"medusa: resumed from step {trainer.step} of {trainer.total_steps}", flush=True)
        t0 = time.perf_counter()

        def epoch_batches(epoch: int) -> list[Tensor]:
            g = torch.Generator().manual_seed(cfg.seed * 7919 + epoch)
            return list(torch.randperm(n, generator=g).split(cfg.batch_size))

        final = trainer.fit(epoch_batches, self.train_step, self.evaluate)
        export_medusa(self.heads, out)
        write_training_json(out, "medusa", self.setup, {**asdict(cfg), **asdict(self.s)}, final, trainer.history,
                            self.setup.vocab_report(self.vocab),
                            {"train_time_s": round(time.perf_counter() - t0, 1), "train_positions": n,
                             "load_with": "specair.models.medusa.load_medusa(DIR, target)"})
        if not keep_checkpoint:
            shutil.rmtree(out / "checkpoint", ignore_errors=True)
        return final

    def _heldout_positions(self) -> tuple[Tensor, Tensor]:
        """Held-out positions; `_ecomplete` marks those whose every head's true token is an answer token
        (the chain starts the acceptance eval counts)."""
        h, t, complete = [], [], []
        for s in self.setup.heldout:
            sh, st = flatten_positions([s], self.s.num_heads, self.to_index)
            p = torch.arange(max(s.prompt_len - 2, 0), max(s.prompt_len - 2, 0) + sh.shape[0])
            complete.append(p + 1 + self.s.num_heads < int(s.tokens.numel()))
            h.append(sh)
            t.append(st)
        self._ecomplete = torch.cat(complete) if complete else torch.zeros(0, dtype=torch.bool)
        H = self.setup.target.config.hidden_size
        if not h:
            return torch.zeros(0, H, dtype=torch.float16), torch.zeros(0, self.s.num_heads, dtype=torch.long)
        return torch.cat(h), torch.cat(t)


def export_medusa(heads: MedusaHeads, out: Path, dtype: torch.dtype = torch.float16) -> None:
    """save_medusa's layout with the weights cast to `dtype` (shipped heads are float16)."""
    save_medusa(heads, out)
    cast_safetensors(out / WEIGHTS_NAME, dtype)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = MedusaSettings()
    p.add_argument("--num-heads", type=int, default=d.num_heads, help="Medusa heads (draft depth)")
    p.add_argument("--num-layers", type=int, default=d.num_layers, help="ResBlocks per head")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                   help="draft vocabulary: the N most frequent answer tokens (0 = full vocabulary)")
    p.add_argument("--head-decay", type=float, default=d.head_decay, help="loss weight decay per head")


def settings_from_args(args: argparse.Namespace) -> MedusaSettings:
    return MedusaSettings(num_heads=args.num_heads, num_layers=args.num_layers, draft_vocab=args.draft_vocab,
                          head_decay=args.head_decay)


__all__ = ["MedusaRecipe", "MedusaSettings", "export_medusa", "flatten_positions", "load_medusa"]
