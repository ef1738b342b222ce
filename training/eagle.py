"""EAGLE head training on cached target hidden states.

Entry p of the head holds (token x_{p+1}, target hidden h_p) at position p; its output feature f_p
regresses h_{p+1}, whose LM-head logits predict x_{p+2}. The loss is EAGLE-1's: smooth-L1 between f_p
and h_{p+1} plus `ce_weight` x the cross-entropy of the head's logits against the target's distribution
softmax(LM(h_{p+1})), with uniform noise on the input hidden states (EAGLE-1 §4).

Training-time test (EAGLE-3): with `unroll` > 1 the head is also run on its own features, as it is when
drafting depth 2, 3, ...: the chain started at p feeds (x_{p+s}, f^{s-1}_p) at position p+s-1, attending
to the true entries 0..p and to its own earlier entries of that chain (a diagonal mask per step), and is
scored against h_{p+s}. Deep positions decide tau, and a head trained only on true features drifts there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specair.models.eagle import EagleHead, load_eagle, save_eagle
from specair.models.eagle3 import Eagle3Head
from specair.models.errors import InputError
from specair.models.llama import AttentionInputs, apply_rope, use_attention
from specair.training.acceptance import AcceptanceCounter, chain_starts, true_token_rank
from specair.training.data import Batch, collate, length_grouped_batches
from specair.training.setup import TrainingSetup, cast_safetensors, write_training_json
from specair.training.trainer import TrainConfig, Trainer


@dataclass
class EagleSettings:
    """What the EAGLE recipe adds to the shared optimisation settings."""

    draft_vocab: int = 8192  # 0: the full vocabulary
    unroll: int = 3  # steps on the head's own features per chain (1 = EAGLE-1 teacher forcing only)
    step_decay: float = 0.8  # loss weight of unroll step s is step_decay ** (s - 1)
    ce_weight: float = 0.1  # EAGLE-1's p_w (feature regression weight v_w = 1)
    noise: float = 0.1  # half-width of the uniform noise added to the input hidden states
    eval_depth: int = 6  # draft depth of the offline acceptance eval
    init: str = "identity"  # "identity": the head starts as f_p = h_p (see EagleRecipe._init_identity); "random"


def _causal(n: int, dtype: torch.dtype) -> Tensor:
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)


def _diagonal(n: int, dtype: torch.dtype) -> Tensor:
    return torch.where(torch.eye(n, dtype=torch.bool), 0.0, torch.finfo(dtype).min).to(dtype)


def fused_attention(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_past: Tensor, v_past: Tensor,
                    mask: Tensor, k_prev: Tensor | None, v_prev: Tensor | None, scale: float,
                    heads: tuple[int, int], inputs: AttentionInputs) -> tuple[Tensor, Tensor]:
    """`rope_attend`'s result through torch's fused attention, forward and backward: an unrolled chain's
    step s attends to N * s keys, and the unfused scores [B, H, N, N * s] would dominate a training step.
    Training only; the graphs keep `attend`."""
    B, T, _ = q.shape
    H, Hkv = heads
    D = q.shape[-1] // H
    q = apply_rope(q.view(B, T, H, D), cos, sin).transpose(1, 2)
    k = apply_rope(k.view(B, T, Hkv, D), cos, sin)
    new_k, new_v = k.transpose(1, 2), v.view(B, T, Hkv, D).transpose(1, 2)
    keys = torch.cat([k_past] + ([k_prev] if k_prev is not None else []) + [new_k], dim=2)
    values = torch.cat([v_past] + ([v_prev] if v_prev is not None else []) + [new_v], dim=2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.view(mask.shape[0], 1, T, -1),
                                         scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(B, T, H * D), k


def unroll_features(head: EagleHead | Eagle3Head, tokens: Tensor, hidden: Tensor, steps: int,
                    noise: float = 0.0) -> list[Tensor]:
    """The head's features along chains started at every position, for depths 1..steps.

    tokens [B, T], hidden [B, T, F] (the target's: its final hidden state for EAGLE, its layer features for
    EAGLE-3). Returns `steps` tensors [B, N, H], N = T - 1: element
    [:, p] of step s is the head's estimate of h_{p+s} on the chain whose true entries end at p. Step 1
    is teacher-forced (x_{p+1}, h_p); step s > 1 feeds (x_{p+s}, the step s-1 feature). Tokens past the
    end of a row are clamped to its last slot: callers mask those chains out.
    """
    B, T = tokens.shape
    N = T - 1
    layer, dtype = head.layers[0], head.dtype
    h_in = hidden[:, :-1].to(dtype)
    if noise > 0:
        h_in = h_in + (torch.rand_like(h_in) * 2 - 1) * noise
    p = torch.arange(N, device=tokens.device)
    max_pos = head.rope_cos.shape[0] - 1
    c = head.config
    empty = hidden.new_zeros(B, c.num_kv_heads, 0, c.head_dim, dtype=dtype)
    causal, diag = _causal(N, dtype), _diagonal(N, dtype)
    feats: list[Tensor] = []
    k1 = v1 = prev_k = prev_v = None
    # The fused kernel reads only the tensors and the mask; these inputs say what the keys are.
    inputs = AttentionInputs(torch.zeros(B, dtype=torch.long), None, None, p.expand(B, N),
                             (head.rope_cos, head.rope_sin))
    with use_attention(fused_attention):
        for s in range(1, steps + 1):
            tok = tokens[:, (p + s).clamp(max=T - 1)]
            x = head.layer_inputs(tok, h_in if s == 1 else feats[-1])
            pos = (p + s - 1).clamp(max=max_pos)
            cos, sin = head.rope_cos[pos].view(1, N, 1, -1), head.rope_sin[pos].view(1, N, 1, -1)
            if s == 1:
                out, k1, v1 = layer(*x, cos, sin, empty, empty, causal.view(1, 1, 1, N, N), None, None, inputs)
            else:
                # Keys: step 1's true entries (j <= p), then this chain's own entries of steps 2..s.
                mask = torch.cat([causal] + [diag] * (s - 1), dim=-1).view(1, 1, 1, N, N * s)
                out, k, v = layer(*x, cos, sin, k1, v1, mask, prev_k, prev_v, inputs)
                prev_k = k if prev_k is None else torch.cat([prev_k, k], dim=2)
                prev_v = v if prev_v is None else torch.cat([prev_v, v], dim=2)
            feats.append(out)
    return feats


def _full_to_reduced(head: EagleHead) -> Tensor | None:
    """[V] map from full-vocabulary ids to draft-vocabulary indices (-1 outside it); None without one."""
    if head.draft_vocab is None:
        return None
    m = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    m[head.draft_vocab.cpu()] = torch.arange(head.draft_vocab.numel())
    return m


class EagleRecipe:
    """Trains an EagleHead over a frozen target from a TrainingSetup."""

    name = "eagle"
    load_with = "specair.models.eagle.load_eagle(DIR, target)"

    def __init__(self, setup: TrainingSetup, settings: EagleSettings) -> None:
        self.setup, self.s = setup, settings
        self.vocab = setup.draft_vocab(settings.draft_vocab)
        self.head = self.make_head()
        self.params = {n: p for n, p in self.head.named_parameters()
                       if any(p is q for q in self.head.own_parameters())}
        if settings.init == "identity":
            self._init_identity()
        elif settings.init != "random":
            self._init_from(Path(settings.init))
        self.head.train()
        self.to_reduced = _full_to_reduced(self.head)
        for p in self.params.values():
            p.requires_grad_(True)

    @classmethod
    def around(cls, setup: TrainingSetup, settings: EagleSettings, head: EagleHead) -> "EagleRecipe":
        """The recipe over an existing head (a shipped or loaded one), to evaluate it as training does."""
        self = cls.__new__(cls)
        self.setup, self.s, self.head, self.vocab = setup, settings, head, head.draft_vocab
        self.to_reduced, self.params = _full_to_reduced(head), {}
        return self

    def make_head(self) -> EagleHead:
        return EagleHead(self.setup.target, draft_vocab=self.vocab)

    @staticmethod
    def load_head(path: Path, target: Any) -> EagleHead:
        return load_eagle(path, target)

    def _init_from(self, path: Path) -> None:
        """Warm start from a trained head of this recipe over the same draft vocabulary: its weights, with a
        fresh optimizer and schedule (to go on with the same ones, use --resume)."""
        if not path.is_dir():
            raise InputError(f"--init {path}: expected 'identity', 'random' or the directory of a trained "
                             f"{self.name} head")
        trained = self.load_head(path, self.setup.target)
        a, b = trained.draft_vocab, self.vocab
        if (a is None) != (b is None) or (a is not None and not torch.equal(a.cpu(), b.cpu())):
            raise InputError(f"--init {path}: its draft vocabulary differs from this run's (--draft-vocab)")
        weights = dict(trained.named_parameters())
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(weights[name].to(p.dtype))

    def inputs(self, batch: Batch) -> Tensor:
        """The target states the head reads: its final hidden state."""
        return batch.hidden

    def collate(self, seqs: list) -> Batch:
        return collate(seqs)

    def export(self, out: Path) -> None:
        export_eagle(self.head, out)

    def _init_identity(self) -> None:
        """fc passes the hidden half through and the layer's output projections start at zero, so the untrained
        head returns its input hidden state: training starts from "h_{p+1} ~ h_p" and learns the difference,
        instead of from a random feature the LM head turns into noise."""
        H = self.head.config.hidden_size
        layer = self.head.layers[0]
        with torch.no_grad():
            self.head.fc.weight.zero_()
            self.head.fc.weight[:, H:] = torch.eye(H)
            if self.head.fc.bias is not None:
                self.head.fc.bias.zero_()
            layer.attention.wo.weight.zero_()
            layer.feed_forward.w2.weight.zero_()

    def _targets(self, tokens: Tensor) -> Tensor:
        """Token ids as the head's logit indices (-1 where outside the draft vocabulary)."""
        return tokens if self.to_reduced is None else self.to_reduced[tokens]

    def losses(self, batch: Batch, steps: int, noise: float) -> tuple[Tensor, dict]:
        """Weighted loss over unroll steps and per-step metrics (on answer positions only)."""
        head, s = self.head, self.s
        feats = unroll_features(head, batch.tokens, self.inputs(batch), steps, noise)
        T = batch.tokens.shape[1]
        N = T - 1
        p = torch.arange(N)
        answer = batch.target_mask()  # [B, T]: index t is a real answer token
        total = batch.hidden.new_zeros(())
        metrics: dict[str, float] = {}
        weight_sum = 0.0
        for step, f in enumerate(feats, 1):
            nxt = p + step + 1  # the token this step's logits predict
            valid = answer[:, nxt.clamp(max=T - 1)] & (nxt <= T - 1)
            if not valid.any():
                continue
            rows, cols = valid.nonzero(as_tuple=True)
            h_t = batch.hidden[rows, cols + step]  # [n, H]
            f_v = f[rows, cols]
            vloss = F.smooth_l1_loss(f_v, h_t, reduction="none").mean(-1)
            logp = head.logits(f_v, reduced=True).float().log_softmax(-1)
            with torch.no_grad():
                target_p = head.logits(h_t, reduced=True).float().softmax(-1)
            ploss = -(target_p * logp).sum(-1)
            w = s.step_decay ** (step - 1)
            total = total + w * (vloss.mean() + s.ce_weight * ploss.mean())
            weight_sum += w
            metrics[f"v{step}"] = float(vloss.detach().mean())
            metrics[f"acc{step}"] = float((logp.detach().argmax(-1) == target_p.argmax(-1)).float().mean())
        return total / max(weight_sum, 1e-9), metrics

    def train_step(self, indices: list[int], step: int) -> dict:
        batch = self.collate([self._train[i] for i in indices])
        loss, metrics = self.losses(batch, self.s.unroll, self.s.noise)
        return {"loss": loss, **{k: v for k, v in metrics.items() if k in ("acc1", f"acc{self.s.unroll}")}}

    @torch.no_grad()
    def evaluate(self, batch_size: int = 8) -> dict:
        """Held-out loss (teacher-forced step) and offline greedy acceptance to `eval_depth`."""
        head, depth = self.head, self.s.eval_depth
        head.eval()
        counter = AcceptanceCounter(depth)
        losses = []
        seqs = self.setup.heldout
        for b in range(0, len(seqs), batch_size):
            batch = self.collate(seqs[b:b + batch_size])
            loss, _ = self.losses(batch, 1, 0.0)
            losses.append(float(loss))
            feats = unroll_features(head, batch.tokens, self.inputs(batch), depth)
            T = batch.tokens.shape[1]
            N = T - 1
            p = torch.arange(N)
            ranks = []
            for d, f in enumerate(feats, 1):
                true_tok = self._targets(batch.tokens[:, (p + d + 1).clamp(max=T - 1)])
                ranks.append(true_token_rank(head.logits(f, reduced=True), true_tok))
            starts = chain_starts(batch.lengths, batch.prompt_lens, N, depth, offset=2)
            ranks = torch.stack(ranks, -1)
            counter.add(ranks[starts])
            for row, mask in zip(ranks, starts):  # the engine's first draft follows the prefill's first token
                counter.add_walk(row[mask][1:])
        head.train()
        return {"heldout_loss": round(sum(losses) / max(len(losses), 1), 5), "acceptance": counter.result()}

    def fit(self, cfg: TrainConfig, out: Path, resume: bool, keep_checkpoint: bool = False) -> dict:
        """Train, then write the head (fp16, SafeAILab layout) and training.json to `out`."""
        self._train = self.setup.train
        lengths = [int(x.tokens.numel()) for x in self._train]
        steps_per_epoch = -(-len(self._train) // cfg.batch_size)
        trainer = Trainer(self.params, cfg, out / "checkpoint", steps_per_epoch, desc=self.name)
        if resume and trainer.load_latest():
            print(f"{self.name}: resumed from step {trainer.step} of {trainer.total_steps}", flush=True)
        t0 = time.perf_counter()
        final = trainer.fit(lambda epoch: length_grouped_batches(lengths, cfg.batch_size, cfg.seed * 7919 + epoch),
                            self.train_step, self.evaluate)
        extra = {"train_time_s": round(time.perf_counter() - t0, 1), "load_with": self.load_with}
        before = Path(self.s.init) / "training.json"
        if before.is_file():  # a warm start: the record of the run it went on from, so the head's history is whole
            extra["init_from"] = json.loads(before.read_text())
        self.export(out)
        write_training_json(out, self.name, self.setup, {**asdict(cfg), **asdict(self.s)}, final, trainer.history,
                            self.setup.vocab_report(self.vocab), extra)
        if not keep_checkpoint:
            shutil.rmtree(out / "checkpoint", ignore_errors=True)
        return final


def export_eagle(head: EagleHead, out: Path, dtype: torch.dtype = torch.float16) -> None:
    """save_eagle's layout with the weights cast to `dtype` (shipped heads are float16)."""
    save_eagle(head, out)
    cast_safetensors(out / "model.safetensors", dtype)


def add_head_arguments(p: argparse.ArgumentParser, d: EagleSettings | Any, identity_help: str) -> None:
    """The options EAGLE and EAGLE-3 share, with `d`'s defaults."""
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                   help="draft vocabulary: the N most frequent answer tokens (0 = full vocabulary)")
    p.add_argument("--unroll", type=int, default=d.unroll,
                   help="training-time-test steps on the head's own features (1 = teacher forcing only)")
    p.add_argument("--step-decay", type=float, default=d.step_decay, help="loss weight decay per unroll step")
    p.add_argument("--noise", type=float, default=d.noise, help="uniform noise half-width on the input states")
    p.add_argument("--eval-depth", type=int, default=d.eval_depth, help="draft depth of the held-out eval")
    p.add_argument("--init", default=d.init,
                   help=f"identity: {identity_help}; random: default init; or the directory of a trained head "
                        "of this recipe to go on from (its weights, a fresh optimizer and schedule)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = EagleSettings()
    add_head_arguments(p, d, "the untrained head returns its input hidden state")
    p.add_argument("--ce-weight", type=float, default=d.ce_weight, help="weight of the cross-entropy term")


def settings_from_args(args: argparse.Namespace) -> EagleSettings:
    return EagleSettings(draft_vocab=args.draft_vocab, unroll=args.unroll, step_decay=args.step_decay,
                         ce_weight=args.ce_weight, noise=args.noise, eval_depth=args.eval_depth, init=args.init)


__all__ = ["EagleRecipe", "EagleSettings", "export_eagle", "load_eagle", "unroll_features"]
