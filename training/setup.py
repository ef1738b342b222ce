"""What every recipe starts from (the target, its distilled set, the train/held-out split, a draft
vocabulary) and what it ends with (weights cast for shipping, `training.json`)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specair.models.errors import InputError
from specair.models.llama import Transformer
from specair.training.data import build_draft_vocab, vocab_coverage
from specair.training.distill import DistilledData, DistilledSequence, distill


@dataclass
class DataOptions:
    """Where the distilled set comes from (see distill.distill)."""

    target: str | None = None  # checkpoint path; None = the default model
    cache_dir: str | None = None
    prompts: str | None = None  # prompt-set JSONL; None = the shipped set
    max_prompts: int | None = None
    max_new_tokens: int = 256
    gen_batch: int = 16
    magpie: int = 0  # self-generated prompts added to the set (training.magpie), 0 = none
    magpie_seed: int = 0
    eval_sequences: int = 512  # held-out sequences the evaluations read (the first ones; 0 = all)


@dataclass
class TrainingSetup:
    """The target (float32, frozen) and its distilled set."""

    target: Transformer
    tokenizer: Any
    fingerprint: str
    data: DistilledData
    options: DataOptions
    started: float = field(default_factory=time.perf_counter)

    @property
    def train(self) -> list[DistilledSequence]:
        return self.data.split("train")

    @property
    def heldout(self) -> list[DistilledSequence]:
        """The held-out sequences evaluations read: the first `options.eval_sequences` (all for 0)."""
        held = self.data.split("heldout")
        return held[:self.options.eval_sequences] if self.options.eval_sequences else held

    def draft_vocab(self, size: int) -> Tensor | None:
        """The `size` most frequent answer tokens of the training split (None for 0 or >= the vocabulary)."""
        V = self.target.config.vocab_size
        if size == 0 or size >= V:
            return None
        return build_draft_vocab(self.train, V, size, always=self.target.config.eos_token_ids)

    def vocab_report(self, ids: Tensor | None) -> dict:
        V = self.target.config.vocab_size
        return {"size": V if ids is None else int(ids.numel()),
                "train_answer_coverage": round(vocab_coverage(self.train, ids, V), 5),
                "heldout_answer_coverage": round(vocab_coverage(self.heldout, ids, V), 5)}


def load_target(path: str | None) -> tuple[Transformer, Any, str]:
    """The target in float32 with frozen weights, its tokenizer and fingerprint."""
    from specair.models.checkpoint import load_checkpoint
    from specair.models.llama import build_model

    ckpt = load_checkpoint(path, dtype=torch.float32)
    return build_model(ckpt.config, ckpt.state_dict, torch.float32), ckpt.tokenizer, ckpt.fingerprint


def prepare(options: DataOptions, threads: int | None = None) -> TrainingSetup:
    """Load the target and build (or load) its distilled set."""
    if threads:
        torch.set_num_threads(threads)
    target, tokenizer, fingerprint = load_target(options.target)
    extra, magpie_report = [], None
    if options.magpie:
        from specair.training import magpie

        directory = magpie.default_dir(fingerprint, options.magpie_seed)
        settings = magpie.MagpieSettings(count=options.magpie, seed=options.magpie_seed)
        extra = magpie.cached_prompts(directory, settings, fingerprint)
        if extra is None:
            batch = max(options.gen_batch, magpie.GEN_BATCH)
            llm = magpie.open_llm(options.target, settings, batch)
            extra = magpie.generate_prompts(llm, directory, settings, fingerprint, batch=8 * batch)
            del llm
        magpie_report = magpie.report(directory)
    data = distill(target, fingerprint, options.target,
                   cache=Path(options.cache_dir) if options.cache_dir else None, prompts_path=options.prompts,
                   extra_records=extra, max_prompts=options.max_prompts, max_new_tokens=options.max_new_tokens,
                   gen_batch=options.gen_batch, tokenizer=tokenizer)
    if magpie_report is not None:
        data.meta["magpie"] = magpie_report
    if not data.split("train"):
        raise InputError("the distilled set has no training sequences; raise --max-prompts")
    if not data.split("heldout"):
        raise InputError("the distilled set has no held-out sequences; raise --max-prompts (about one prompt "
                         "in ten is held out)")
    return TrainingSetup(target, tokenizer, fingerprint, data, options)


def cast_safetensors(path: Path, dtype: torch.dtype) -> None:
    """Rewrite a safetensors file with its floating tensors in `dtype` (integer tensors untouched)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as st:
        meta = st.metadata()
        tensors = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118 (safe_open is not iterable)
    tensors = {k: (t.to(dtype) if t.is_floating_point() else t).contiguous() for k, t in tensors.items()}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.chmod(tmp, 0o644)  # safetensors writes files owner-only; shipped files are read by everyone
    tmp.replace(path)


def command_line() -> str:
    """The command that is running, as a user would retype it."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("specair", "cli.py", "__main__.py"):
        argv[0] = "specair"
    return shlex.join(argv)


def write_training_json(out: Path, recipe: str, setup: TrainingSetup, settings: dict, final_eval: dict,
                        history: list[dict], vocab: dict | None, extra: dict | None = None) -> dict:
    """Record how a head was made and what it reaches on the held-out split."""
    opts = setup.options
    record = {
        "recipe": recipe,
        "command": command_line(),
        "target": opts.target or "default (SmolLM2-135M-Instruct)",
        "target_fingerprint": setup.fingerprint,
        "data": {"prompt_set": opts.prompts or "specair/training/prompts.jsonl", "max_prompts": opts.max_prompts,
                 "magpie_prompts": opts.magpie, "max_new_tokens": opts.max_new_tokens,
                 "eval_sequences": len(setup.heldout),
                 "decoding": "greedy, the target's chat template, through --backend auto",
                 **setup.data.summary(), "magpie": setup.data.meta.get("magpie"),
                 "distillation": setup.data.meta.get("progress")},
        "draft_vocab": vocab,
        "settings": settings,
        "heldout_eval": final_eval,
        "history": history,
        "wall_time_s": round(time.perf_counter() - setup.started, 1),
        "machine": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor()
                    or platform.machine()},
        **(extra or {}),
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record
