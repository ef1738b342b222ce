"""EAGLE-3 head training on recorded target features, with training-time test.

The head reads the target's layer features (fused by fc) at the first step of every chain and its own
outputs after that (`training.eagle.unroll_features`, which both heads share), and is scored at every
step by EAGLE-3's loss: the cross-entropy of its draft-vocabulary logits against the target's distribution
restricted to the draft vocabulary (as a KL divergence, which has the same gradient), at positions whose
target argmax lies in it (no feature regression:
EAGLE-3 predicts tokens directly). Step s weighs step_decay ** (s - 1).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from specair.models.eagle3 import Eagle3Head, default_feature_layers, load_eagle3, save_eagle3
from specair.models.errors import InputError
from specair.training.data import Batch, collate
from specair.training.eagle import EagleRecipe, add_head_arguments, unroll_features
from specair.training.setup import TrainingSetup, cast_safetensors


@dataclass
class Eagle3Settings:
    """What the EAGLE-3 recipe adds to the shared optimisation settings."""

    draft_vocab: int = 8192  # 0: the full vocabulary
    unroll: int = 5  # training-time-test steps (EAGLE-3's paper uses 7)
    step_decay: float = 0.8
    noise: float = 0.0  # EAGLE-3 trains without input noise: the unrolled steps already show it its own errors
    eval_depth: int = 6
    init: str = "identity"  # "identity": fc picks the highest feature, the layer adds nothing at first; "random"


def _target_rows(setup: TrainingSetup, vocab: Tensor | None) -> Tensor:
    """The target's LM-head rows of the draft vocabulary [Vd, H] (the whole head without one)."""
    t = setup.target
    w = t.tok_embeddings.weight if t.output is None else t.output.weight
    return w if vocab is None else w[vocab.to(w.device)]


class Eagle3Recipe(EagleRecipe):
    """Trains an Eagle3Head over a frozen target from a TrainingSetup (features recorded at distillation)."""

    name = "eagle3"
    load_with = "specair.models.eagle3.load_eagle3(DIR, target)"

    def __init__(self, setup: TrainingSetup, settings: Eagle3Settings) -> None:
        layers = tuple(setup.data.meta.get("feature_layers") or ())
        if layers != default_feature_layers(setup.target.config.num_layers):
            raise InputError(f"the distilled set recorded features of layers {list(layers)}; EAGLE-3 reads "
                             f"{list(default_feature_layers(setup.target.config.num_layers))}")
        super().__init__(setup, settings)
        self.target_rows = _target_rows(setup, self.vocab)

    @classmethod
    def around(cls, setup: TrainingSetup, settings: Eagle3Settings, head: Eagle3Head) -> "Eagle3Recipe":
        self = super().around(setup, settings, head)
        self.target_rows = _target_rows(setup, self.vocab)
        return self

    def make_head(self) -> Eagle3Head:
        head = Eagle3Head(self.setup.target, draft_vocab=self.vocab)
        with torch.no_grad():  # start from the target's own readout over the draft vocabulary
            head.lm_head.weight.copy_(_target_rows(self.setup, self.vocab))
            head.norm.weight.copy_(self.setup.target.norm.weight)
        return head

    @staticmethod
    def load_head(path: Path, target) -> Eagle3Head:
        return load_eagle3(path, target)

    def _init_identity(self) -> None:
        """fc passes the highest feature through and the layer's output projections start at zero, so the
        untrained head reads out the residual stream entering layer L-3 through the target's norm and LM head."""
        H = self.head.config.hidden_size
        layer = self.head.layers[0]
        with torch.no_grad():
            self.head.fc.weight.zero_()
            self.head.fc.weight[:, -H:] = torch.eye(H)
            layer.attention.wo.weight.zero_()
            layer.feed_forward.w2.weight.zero_()

    def inputs(self, batch: Batch) -> Tensor:
        """The target states the head reads: its layer features."""
        return batch.features

    def collate(self, seqs: list) -> Batch:
        return collate(seqs, with_features=True)

    def losses(self, batch: Batch, steps: int, noise: float) -> tuple[Tensor, dict]:
        """EAGLE-3's loss over unroll steps and per-step metrics (on answer positions only)."""
        head, s = self.head, self.s
        feats = unroll_features(head, batch.tokens, batch.features, steps, noise)
        T = batch.tokens.shape[1]
        p = torch.arange(T - 1)
        answer = batch.target_mask()
        total = batch.hidden.new_zeros(())
        metrics: dict[str, float] = {}
        weight_sum = 0.0
        with torch.no_grad():  # every step reads the same target distributions, shifted
            target_all = (batch.hidden @ self.target_rows.t()).float().log_softmax(-1)
        for step, f in enumerate(feats, 1):
            nxt = p + step + 1  # the token this step's logits predict, from the target's state at nxt - 1
            valid = answer[:, nxt.clamp(max=T - 1)] & (nxt <= T - 1)
            if not valid.any():
                continue
            with torch.no_grad():
                rows, cols = valid.nonzero(as_tuple=True)  # index pairs: never a [B, N, V] gather
                # The greedy next token (the target's argmax) must be a draft token, or no draft logit can match it.
                true_tok = self._targets(batch.tokens[rows, cols + step + 1])
                keep = true_tok >= 0
                rows, cols, true_tok = rows[keep], cols[keep], true_tok[keep]
            if not rows.numel():
                continue
            logp = head.logits(f[rows, cols], reduced=True).float().log_softmax(-1)
            target_logp = target_all[rows, cols + step]
            # KL(target || draft): the cross-entropy's gradient, with the target's entropy taken off its value
            loss = (target_logp.exp() * (target_logp - logp)).sum(-1).mean()
            w = s.step_decay ** (step - 1)
            total = total + w * loss
            weight_sum += w
            metrics[f"kl{step}"] = float(loss.detach())
            metrics[f"acc{step}"] = float((logp.detach().argmax(-1) == true_tok).float().mean())
        return total / max(weight_sum, 1e-9), metrics

    def export(self, out: Path) -> None:
        export_eagle3(self.head, out)


def export_eagle3(head: Eagle3Head, out: Path, dtype: torch.dtype = torch.float16) -> None:
    """save_eagle3's layout with the weights cast to `dtype` (shipped heads are float16)."""
    save_eagle3(head, out)
    cast_safetensors(out / "model.safetensors", dtype)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_head_arguments(p, Eagle3Settings(), "the untrained head reads out the highest feature")


def settings_from_args(args: argparse.Namespace) -> Eagle3Settings:
    if args.unroll < 1:
        raise InputError("--unroll must be at least 1")
    return Eagle3Settings(draft_vocab=args.draft_vocab, unroll=args.unroll, step_decay=args.step_decay,
                          noise=args.noise, eval_depth=args.eval_depth, init=args.init)


__all__ = ["Eagle3Recipe", "Eagle3Settings", "export_eagle3", "load_eagle3"]
