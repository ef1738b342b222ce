"""The loop every recipe shares: AdamW, linear warmup then cosine decay, gradient clipping, a progress bar,
periodic held-out eval, and checkpoints that resume exactly.

A checkpoint is a directory `step-NNNNNN/` under the checkpoint dir, holding the trainable weights and the
optimizer state (`state.safetensors`) and the step, config and history (`state.json`); it is written
under a temporary name and renamed, so a crash never leaves a half-written one. Batch order comes from
`(seed, epoch)` and per-step randomness from `(seed, step)`, so a resumed run takes the same steps as an
uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Callable

import torch
from torch import Tensor, nn
from tqdm import tqdm

from specair.models.errors import InputError


@dataclass
class TrainConfig:
    """Optimisation settings shared by the recipes."""

    epochs: float = 1.0
    lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.0
    batch_size: int = 8
    grad_clip: float = 1.0
    eval_every: int = 200
    save_every: int = 200
    max_steps: int | None = None
    seed: int = 0
    precision: str = "fp32"  # "bf16": the training forward under CPU/CUDA autocast (weights and optimizer stay fp32)


def cosine_lr(step: int, total: int, warmup: int, base: float, floor: float = 0.02) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to floor * base at `total`."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    """Runs `train_step` over the batches of each epoch and `evaluate` every `eval_every` steps."""

    def __init__(self, params: dict[str, nn.Parameter], cfg: TrainConfig, checkpoint_dir: Path,
                 steps_per_epoch: int, desc: str = "train") -> None:
        if steps_per_epoch < 1:
            raise InputError("no training batches: the distilled training split is empty")
        if cfg.precision not in ("fp32", "bf16"):
            raise InputError(f"unknown training precision {cfg.precision!r} (fp32, bf16)")
        self.device_type = next(iter(params.values())).device.type if params else "cpu"
        self.params, self.cfg, self.dir, self.desc = params, cfg, Path(checkpoint_dir), desc
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
        self.step = 0
        self.history: list[dict] = []

    # ---- checkpoints ----

    def _checkpoints(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))

    def save(self) -> Path:
        """Write a checkpoint for the current step and delete older ones."""
        from safetensors.torch import save_file

        tensors = {f"param.{name}": p.detach().contiguous().clone() for name, p in self.params.items()}
        opt = self.opt.state_dict()
        for idx, state in opt["state"].items():
            for key, value in state.items():
                tensors[f"opt.{idx}.{key}"] = torch.as_tensor(value).detach().contiguous().clone()
        meta = {"step": self.step, "total_steps": self.total_steps, "config": asdict(self.cfg),
                "param_groups": opt["param_groups"], "history": self.history}
        final = self.dir / f"step-{self.step:06d}"
        tmp = self.dir / f"step-{self.step:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / "state.safetensors"))
        (tmp / "state.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in self._checkpoints():
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def load_latest(self) -> bool:
        """Restore the newest checkpoint, if any; returns whether one was found."""
        from safetensors.torch import load_file

        found = self._checkpoints()
        if not found:
            return False
        ckpt = found[-1]
        meta = json.loads((ckpt / "state.json").read_text(encoding="utf-8"))
        tensors = load_file(str(ckpt / "state.safetensors"))
        missing = [n for n in self.params if f"param.{n}" not in tensors]
        if missing:
            raise InputError(f"{ckpt}: checkpoint lacks {missing[:3]}; it was written by another recipe or shape")
        with torch.no_grad():
            for name, p in self.params.items():
                t = tensors[f"param.{name}"]
                if t.shape != p.shape:
                    raise InputError(f"{ckpt}: {name} has shape {tuple(t.shape)}, this run's is {tuple(p.shape)}")
                p.copy_(t)
        state: dict[int, dict[str, Tensor]] = {}
        for key, t in tensors.items():
            if key.startswith("opt."):
                _, idx, name = key.split(".", 2)
                state.setdefault(int(idx), {})[name] = t
        self.opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        self.step, self.history = int(meta["step"]), list(meta["history"])
        return True

    # ---- the loop ----

    def fit(self, epoch_batches: Callable[[int], list], train_step: Callable[[object, int], dict],
            evaluate: Callable[[], dict], log: Callable[[str], None] = tqdm.write) -> dict:
        """Train to `total_steps`. train_step(batch_spec, step) returns {"loss": tensor, ...floats};
        evaluate() returns a dict of held-out metrics. Returns the last eval."""
        cfg = self.cfg
        last_eval: dict = {}
        bar = tqdm(total=self.total_steps, initial=self.step, desc=self.desc, unit="step")
        t0 = time.perf_counter()
        running: dict[str, float] = {}
        while self.step < self.total_steps:
            epoch, in_epoch = divmod(self.step, self.steps_per_epoch)
            batches = epoch_batches(epoch)
            for spec in batches[in_epoch:]:
                if self.step >= self.total_steps:
                    break
                lr = cosine_lr(self.step, self.total_steps, cfg.warmup_steps, cfg.lr)
                for group in self.opt.param_groups:
                    group["lr"] = lr
                torch.manual_seed(cfg.seed * 1_000_003 + self.step)
                with torch.autocast(self.device_type, torch.bfloat16, enabled=cfg.precision == "bf16"):
                    out = train_step(spec, self.step)
                self.opt.zero_grad(set_to_none=True)
                out["loss"].backward()
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(list(self.params.values()), cfg.grad_clip)
                self.opt.step()
                self.step += 1
                metrics = {k: float(v.detach() if isinstance(v, Tensor) else v) for k, v in out.items()}
                for k, v in metrics.items():
                    running[k] = v if k not in running else 0.9 * running[k] + 0.1 * v
                bar.set_postfix({k: f"{v:.3g}" for k, v in running.items()} | {"lr": f"{lr:.2g}"})
                bar.update(1)
                done = self.step >= self.total_steps
                if self.step % cfg.eval_every == 0 or done:
                    last_eval = {"step": self.step, "epoch": round(self.step / self.steps_per_epoch, 3),
                                 "train": {k: round(v, 5) for k, v in running.items()},
                                 "elapsed_s": round(time.perf_counter() - t0, 1), **evaluate()}
                    self.history.append(last_eval)
                    log(f"[{self.desc}] step {self.step}: " + format_eval(last_eval))
                if self.step % cfg.save_every == 0 or done:
                    self.save()
        bar.close()
        if not last_eval and self.history:
            last_eval = self.history[-1]
        return last_eval


def format_eval(ev: dict) -> str:
    """One line for a log: held-out loss, tau and acceptance by position."""
    parts = []
    if "heldout_loss" in ev:
        parts.append(f"held-out loss {ev['heldout_loss']:.4f}")
    acc = ev.get("acceptance") or {}
    if "tau_chain" in acc:
        parts.append(f"tau_chain {acc['tau_chain']:.3f}")
        parts.append("accept@d " + " ".join(f"{a:.2f}" for a in acc["acceptance_by_position"]))
        for w in (2, 4, 8):
            if f"tree_w{w}" in acc:
                parts.append(f"tau_tree(w={w}) {acc[f'tree_w{w}']['tau']:.3f}")
    return ", ".join(parts) or json.dumps(ev)
