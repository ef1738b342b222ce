"""Draft-model training: the target's first N layers (with its final norm and tied LM head), fine-tuned by
KL divergence to the target's next-token distribution on the distilled sequences, saved as an HF model
directory that `--speculative-config '{"method": "draft_model", "model": DIR, ...}'` loads.

The target's distribution at every position comes from its cached hidden states through its own LM head,
so no target forward runs during training. Embedding and LM head stay frozen (they are tied to the
target's); the layers and the final norm train.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specair.models.errors import InputError
from specair.models.llama import Transformer
from specair.training.acceptance import AcceptanceCounter, true_token_rank
from specair.training.data import Batch, collate, length_grouped_batches
from specair.training.setup import TrainingSetup, write_training_json
from specair.training.trainer import TrainConfig, Trainer


@dataclass
class DraftSettings:
    """What the draft recipe adds to the shared optimisation settings."""

    num_layers: int = 6  # target layers the draft keeps
    temperature: float = 1.0  # of both distributions in the KL
    eval_depth: int = 5


def first_layers_copy(target: Transformer, num_layers: int) -> Transformer:
    """A new Transformer with copies of the target's first `num_layers` layers and final norm; embedding and
    LM head are the target's own modules (frozen, shared)."""
    if not 0 < num_layers <= target.config.num_layers:
        raise InputError(f"--num-layers must be in 1..{target.config.num_layers}, got {num_layers}")
    with torch.device("meta"):
        draft = Transformer(replace(target.config, num_layers=num_layers), target.dtype)
    draft.tok_embeddings, draft.output = target.tok_embeddings, target.output
    own = {k: v.detach().clone() for k, v in target.state_dict().items()
           if k.startswith("norm.") or (k.startswith("layers.") and int(k.split(".")[1]) < num_layers)}
    draft.load_state_dict(own, strict=False, assign=True)
    draft.rope_cos, draft.rope_sin = target.rope_cos, target.rope_sin
    return draft


def hf_state_dict(model: Transformer) -> dict[str, Tensor]:
    """The model's weights under HF Llama names (the inverse of build_model's mapping)."""
    c = model.config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    sd = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight}
    if model.output is not None:
        sd["lm_head.weight"] = model.output.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        att = layer.attention
        for name, w in zip("qkv", att.wqkv.weight.split([q_dim, kv_dim, kv_dim])):
            sd[p + f"self_attn.{name}_proj.weight"] = w
        if att.wqkv.bias is not None:
            for name, b in zip("qkv", att.wqkv.bias.split([q_dim, kv_dim, kv_dim])):
                sd[p + f"self_attn.{name}_proj.bias"] = b
        sd[p + "self_attn.o_proj.weight"] = att.wo.weight
        gate, up = layer.feed_forward.w13.weight.chunk(2)
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gate, up
        sd[p + "mlp.down_proj.weight"] = layer.feed_forward.w2.weight
        sd[p + "input_layernorm.weight"] = layer.attention_norm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.ffn_norm.weight
    return sd


def save_hf_dir(model: Transformer, tokenizer, out: Path, dtype: torch.dtype = torch.float16) -> None:
    """config.json + model.safetensors (+ tokenizer files) that specair's and transformers' loaders read."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_hf() | {"dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    tensors = {k: v.detach().to(dtype).contiguous().clone() for k, v in hf_state_dict(model).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(out)


class DraftRecipe:
    """Fine-tunes a truncated copy of the target into a draft model."""

    def __init__(self, setup: TrainingSetup, settings: DraftSettings) -> None:
        self.setup, self.s = setup, settings
        self.draft = first_layers_copy(setup.target, settings.num_layers)
        self.params = {n: p for n, p in self.draft.named_parameters()
                       if n.startswith(("layers.", "norm."))}
        for p in self.params.values():
            p.requires_grad_(True)

    def _hidden(self, batch: Batch) -> Tensor:
        B, T = batch.tokens.shape
        k, v = self.draft.empty_cache(B, 0)
        out = self.draft(batch.tokens, torch.arange(T).expand(B, T), torch.zeros(B, dtype=torch.long), k, v,
                         logits_index=torch.zeros(B, 1, dtype=torch.long))
        return out.hidden

    def _positions(self, batch: Batch) -> Tensor:
        """[B, T] positions q whose next token x_{q+1} is a real answer token."""
        nxt = batch.target_mask()
        return torch.cat([nxt[:, 1:], torch.zeros_like(nxt[:, :1])], dim=1)

    def losses(self, batch: Batch) -> tuple[Tensor, dict]:
        """KL(target || draft) at answer positions, and the draft's top-1 agreement with the target."""
        mask = self._positions(batch)
        h = self._hidden(batch)[mask]
        tau = self.s.temperature
        logq = (self.draft.lm_head(h).float() / tau).log_softmax(-1)
        with torch.no_grad():
            logp = (self.setup.target.lm_head(batch.hidden[mask]).float() / tau).log_softmax(-1)
        kl = F.kl_div(logq, logp, log_target=True, reduction="batchmean")
        return kl, {"agree": float((logq.detach().argmax(-1) == logp.argmax(-1)).float().mean())}

    def train_step(self, indices: list[int], step: int) -> dict:
        loss, metrics = self.losses(collate([self._train[i] for i in indices]))
        return {"loss": loss, **metrics}

    @torch.no_grad()
    def evaluate(self, batch_size: int = 4) -> dict:
        """Held-out KL and offline greedy acceptance of a `eval_depth`-token chain."""
        depth = self.s.eval_depth
        counter = AcceptanceCounter(depth)
        losses = []
        seqs = self.setup.heldout
        for b in range(0, len(seqs), batch_size):
            batch = collate(seqs[b:b + batch_size])
            loss, _ = self.losses(batch)
            losses.append(float(loss))
            T = batch.tokens.shape[1]
            logits = self.draft.lm_head(self._hidden(batch))
            nxt = torch.cat([batch.tokens[:, 1:], torch.zeros_like(batch.tokens[:, :1])], dim=1)
            rank = true_token_rank(logits, nxt)  # [B, T]: rank of x_{q+1} at q
            # Chain after committed prefix 0..p: depth d reads logits at p+d-1 and must produce x_{p+d}.
            p = torch.arange(T)
            idx = (p.unsqueeze(1) + torch.arange(depth)).clamp(max=T - 1)  # [T, depth]
            ranks = rank[:, idx]  # [B, T, depth]
            first, last = p + 1, p + depth
            starts = (first >= batch.prompt_lens.unsqueeze(1)) & (last < batch.lengths.unsqueeze(1))
            counter.add(ranks[starts])
        return {"heldout_loss": round(sum(losses) / max(len(losses), 1), 5), "acceptance": counter.result()}

    def fit(self, cfg: TrainConfig, out: Path, resume: bool, keep_checkpoint: bool = False) -> dict:
        """Train, then write the draft as an HF dir (fp16) with training.json to `out`."""
        self._train = self.setup.train
        lengths = [int(x.tokens.numel()) for x in self._train]
        steps_per_epoch = -(-len(self._train) // cfg.batch_size)
        trainer = Trainer(self.params, cfg, out / "checkpoint", steps_per_epoch, desc="draft")
        if resume and trainer.load_latest():
            print(f"draft: resumed from step {trainer.step} of {trainer.total_steps}", flush=True)
        t0 = time.perf_counter()
        before = self.evaluate() if trainer.step == 0 else None
        final = trainer.fit(lambda epoch: length_grouped_batches(lengths, cfg.batch_size, cfg.seed * 7919 + epoch),
                            self.train_step, self.evaluate)
        save_hf_dir(self.draft, self.setup.tokenizer, out)
        write_training_json(out, "draft", self.setup, {**asdict(cfg), **asdict(self.s)}, final, trainer.history,
                            None, {"train_time_s": round(time.perf_counter() - t0, 1),
                                   "heldout_eval_before_training": before,
                                   "use_with": f"--speculative-config '{{\"method\": \"draft_model\", "
                                               f"\"model\": \"{out}\", \"num_speculative_tokens\": 4}}'"})
        if not keep_checkpoint:
            shutil.rmtree(out / "checkpoint", ignore_errors=True)
        return final


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DraftSettings()
    p.add_argument("--num-layers", type=int, default=d.num_layers, help="target layers the draft keeps")
    p.add_argument("--temperature", type=float, default=d.temperature, help="softmax temperature of the KL")
    p.add_argument("--eval-depth", type=int, default=d.eval_depth, help="draft depth of the held-out eval")


def settings_from_args(args: argparse.Namespace) -> DraftSettings:
    return DraftSettings(num_layers=args.num_layers, temperature=args.temperature, eval_depth=args.eval_depth)


__all__ = ["DraftRecipe", "DraftSettings", "first_layers_copy", "hf_state_dict", "save_hf_dir"]
