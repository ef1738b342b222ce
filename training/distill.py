"""Self-distillation: the target answers the prompt set with its own chat template (greedy), and its hidden
states over each full sequence (prompt + answer) are cached for head training.

Cache layout (default `$SPECAIR_CACHE/train/<target fingerprint[:16]>`):

    meta.json                   target, fingerprint, max_new_tokens (a cache built with other settings is refused)
    answers.jsonl               one record per prompt: id, split, category, prompt_ids, answer_ids, finish_reason
    hidden/shard-NNNNN.safetensors  tensor "h.<id>" [prompt + answer length, H] in float16
    hidden/index.json           id -> shard file

Both stages resume: answers are appended a chunk of prompts at a time, hidden states are written a shard
at a time (each file appears atomically), and a rerun skips what is already there.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

import torch
from torch import Tensor
from tqdm import tqdm

from specair.models.errors import InputError
from specair.models.llama import Transformer
from specair.training.prompt_set import load_prompts

CACHE_FORMAT = 1
SHARD_SEQUENCES = 32  # sequences per hidden-state shard: a crash loses at most this many forwards


@dataclass
class DistilledSequence:
    """One prompt and the target's greedy answer, with the target's hidden states over both."""

    id: int
    split: str
    category: str
    tokens: Tensor  # [L] int64: prompt then answer
    prompt_len: int
    hidden: Tensor | None = None  # [L, H] float16 (None until loaded)
    finish_reason: str = "stop"

    @property
    def answer_len(self) -> int:
        return int(self.tokens.numel()) - self.prompt_len


@dataclass
class DistilledData:
    """The distilled set held in memory."""

    sequences: list[DistilledSequence]
    cache_dir: Path
    meta: dict = field(default_factory=dict)

    def split(self, name: str) -> list[DistilledSequence]:
        return [s for s in self.sequences if s.split == name]

    def num_tokens(self, split: str | None = None, answer_only: bool = False) -> int:
        seqs = self.sequences if split is None else self.split(split)
        return sum(s.answer_len if answer_only else int(s.tokens.numel()) for s in seqs)

    def summary(self) -> dict:
        """Sizes for training.json: sequences and tokens per split."""
        out = {}
        for name in ("train", "heldout"):
            seqs = self.split(name)
            out[name] = {"sequences": len(seqs), "tokens": self.num_tokens(name),
                         "answer_tokens": self.num_tokens(name, answer_only=True)}
        return out


def default_cache_dir(fingerprint: str) -> Path:
    """`$SPECAIR_CACHE/train/<fingerprint[:16]>` (see specair.models.default_model.cache_dir)."""
    from specair.models.default_model import cache_dir

    return cache_dir() / "train" / fingerprint[:16]


def select_prompts(records: list[dict], max_prompts: int | None) -> list[dict]:
    """`max_prompts` records keeping the set's held-out share (at least one held out when the set has any):
    the first records of each split, in file order (the shipped set interleaves categories, so any prefix
    covers all of them)."""
    if max_prompts is None or max_prompts >= len(records):
        return records
    if max_prompts < 2:
        raise InputError(f"--max-prompts must be at least 2 (one to train on, one held out), got {max_prompts}")
    held = [r for r in records if r["split"] == "heldout"]
    n_held = min(len(held), max(1 if held else 0, round(max_prompts * len(held) / len(records))))
    keep = {id(r) for r in held[:n_held]}
    keep |= {id(r) for r in [r for r in records if r["split"] != "heldout"][:max_prompts - n_held]}
    return [r for r in records if id(r) in keep]


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _check_meta(cache: Path, meta: dict) -> None:
    f = cache / "meta.json"
    if f.is_file():
        old = json.loads(f.read_text(encoding="utf-8"))
        for key in ("format", "fingerprint", "max_new_tokens"):
            if old.get(key) != meta.get(key):
                raise InputError(f"{cache} holds a distilled set with {key}={old.get(key)!r}, this run asks for "
                                 f"{meta.get(key)!r}; pass another --cache-dir or delete that directory")
    else:
        cache.mkdir(parents=True, exist_ok=True)
        _atomic_write_text(f, json.dumps(meta, indent=2) + "\n")


def read_answers(cache: Path) -> dict[int, dict]:
    """Answer records by prompt id (a torn last line from an interrupted run is ignored)."""
    f = cache / "answers.jsonl"
    out: dict[int, dict] = {}
    if not f.is_file():
        return out
    for line in f.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[int(rec["id"])] = rec
    return out


def generate_answers(records: list[dict], cache: Path, llm: object, max_new_tokens: int) -> list[dict]:
    """Let the target answer every record not yet in answers.jsonl, greedily, through `specair.LLM.generate`
    (continuous batching), and append the answers. Returns the answer records of `records`."""
    from specair.runtime.params import SamplingParams

    done = read_answers(cache)
    todo = [r for r in records if r["id"] not in done]
    if todo:
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
        ids = [llm.encode_chat(r["messages"]) for r in todo]
        results = llm.generate(ids, params, use_tqdm=True)
        with open(cache / "answers.jsonl", "a", encoding="utf-8") as f:
            for rec, prompt_ids, res in zip(todo, ids, results):
                answer = {"id": rec["id"], "split": rec["split"], "category": rec["category"],
                          "prompt_ids": prompt_ids, "answer_ids": list(res.token_ids),
                          "finish_reason": res.finish_reason}
                f.write(json.dumps(answer) + "\n")
                done[rec["id"]] = answer
    return [done[r["id"]] for r in records]


def _check_prompts(records: list[dict], answers: dict[int, dict], tokenizer, cache: Path) -> None:
    """Refuse cached answers whose prompt tokens are not this prompt set's (a changed set or template)."""
    for r in records:
        a = answers.get(r["id"])
        if a is None:
            continue
        if tokenizer.encode_chat(r["messages"]) != a["prompt_ids"]:
            raise InputError(f"{cache}: the cached answer for prompt id {r['id']} was made for another prompt; "
                             "pass another --cache-dir or delete that directory")


def _read_index(cache: Path) -> dict[str, str]:
    f = cache / "hidden" / "index.json"
    return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}


@torch.inference_mode()
def target_hidden(model: Transformer, tokens: Tensor) -> Tensor:
    """The target's hidden states after its final norm for one sequence [L] -> [L, H] (one forward, no cache)."""
    k, v = model.empty_cache(1, 0)
    L = tokens.numel()
    out = model(tokens.view(1, L), torch.arange(L).view(1, L), torch.zeros(1, dtype=torch.long), k, v,
                logits_index=torch.zeros(1, 1, dtype=torch.long))  # one logits row: the LM head is not needed
    return out.hidden[0]


def cache_hidden(answers: list[dict], cache: Path, model: Transformer) -> None:
    """Run the target over every answered sequence not yet cached and write float16 hidden-state shards."""
    from safetensors.torch import save_file

    hdir = cache / "hidden"
    hdir.mkdir(parents=True, exist_ok=True)
    index = _read_index(cache)
    todo = [a for a in answers if str(a["id"]) not in index]
    if not todo:
        return
    shard_no = 1 + max((int(Path(n).stem.split("-")[1]) for n in set(index.values())), default=-1)
    total_tokens = sum(len(a["prompt_ids"]) + len(a["answer_ids"]) for a in todo)
    bar = tqdm(total=total_tokens, desc="hidden states", unit="tok", leave=False)
    for start in range(0, len(todo), SHARD_SEQUENCES):
        part = todo[start:start + SHARD_SEQUENCES]
        tensors = {}
        for a in part:
            tokens = torch.tensor(a["prompt_ids"] + a["answer_ids"], dtype=torch.long)
            tensors[f"h.{a['id']}"] = target_hidden(model, tokens).to(torch.float16).contiguous()
            bar.update(tokens.numel())
        name = f"shard-{shard_no:05d}.safetensors"
        tmp = hdir / f".{name}.tmp"
        save_file(tensors, str(tmp))
        os.replace(tmp, hdir / name)
        index.update({str(a["id"]): name for a in part})
        _atomic_write_text(hdir / "index.json", json.dumps(index) + "\n")
        shard_no += 1
    bar.close()


def distill(model: Transformer, fingerprint: str, target_path: str | None, *, cache: Path | None = None,
            prompts_path: str | Path | None = None, max_prompts: int | None = None, max_new_tokens: int = 256,
            make_llm: Callable[[], object] | None = None, gen_batch: int = 16, chunk: int = 64,
            tokenizer: object | None = None) -> DistilledData:
    """Build (or resume, or just load) the distilled set for the first `max_prompts` prompts and return it.

    model: the target loaded from `target_path` (None: the default model), for the hidden-state forward;
    make_llm: builds the `specair.LLM` that answers (default: `LLM(target_path, batch_buckets=(1, 2, 4, ...,
    gen_batch))`); tokenizer: the target's, to check that cached answers belong to these prompts. Splits and
    categories come from the prompt records, not from the cache."""
    cache = Path(cache) if cache is not None else default_cache_dir(fingerprint)
    records = select_prompts(load_prompts(prompts_path), max_prompts)
    _check_meta(cache, {"format": CACHE_FORMAT, "fingerprint": fingerprint, "max_new_tokens": max_new_tokens,
                        "target": target_path or "default"})
    t0 = time.perf_counter()
    if make_llm is None:
        def make_llm():
            from specair.runtime.llm import LLM

            buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b < gen_batch) + (gen_batch,)
            # The context only needs the longest prompt plus the answer: smaller caches, smaller buckets.
            longest = max(len(tokenizer.encode_chat(r["messages"])) for r in records) if tokenizer is not None else 1024
            return LLM(target_path, batch_buckets=buckets,
                       max_context=min(model.config.max_position_embeddings, longest + max_new_tokens + 1))
    llm = None
    # A chunk of prompts at a time, answers then hidden states, so an interrupted run keeps a usable prefix.
    done_answers, index = read_answers(cache), _read_index(cache)
    if tokenizer is not None:
        _check_prompts(records, done_answers, tokenizer, cache)
    todo = [r for r in records if r["id"] not in done_answers or str(r["id"]) not in index]
    bar = tqdm(total=len(records), initial=len(records) - len(todo), desc="distill", unit="prompt")
    for start in range(0, len(todo), chunk):
        part = todo[start:start + chunk]
        if llm is None and any(r["id"] not in done_answers for r in part):
            llm = make_llm()
        cache_hidden(generate_answers(part, cache, llm, max_new_tokens), cache, model)
        bar.update(len(part))
    bar.close()
    data = load_distilled(cache, [r["id"] for r in records])
    labels = {r["id"]: (r["split"], r["category"]) for r in records}
    for seq in data.sequences:
        seq.split, seq.category = labels[seq.id]
    data.meta["distill_seconds_this_run"] = round(time.perf_counter() - t0, 1)
    return data


def load_distilled(cache: Path, ids: list[int] | None = None, with_hidden: bool = True) -> DistilledData:
    """Load the distilled set (all of it, or the records `ids`) from a cache dir."""
    from safetensors import safe_open

    cache = Path(cache)
    if not (cache / "meta.json").is_file():
        raise InputError(f"{cache}: no distilled set (meta.json missing)")
    meta = json.loads((cache / "meta.json").read_text(encoding="utf-8"))
    answers = read_answers(cache)
    ids = sorted(answers) if ids is None else ids
    missing = [i for i in ids if i not in answers]
    if missing:
        raise InputError(f"{cache}: no answers for prompt ids {missing[:5]}; run the distillation first")
    seqs = []
    for i in ids:
        a = answers[i]
        seqs.append(DistilledSequence(i, a["split"], a["category"],
                                      torch.tensor(a["prompt_ids"] + a["answer_ids"], dtype=torch.long),
                                      len(a["prompt_ids"]), None, a.get("finish_reason", "stop")))
    if with_hidden:
        index = _read_index(cache)
        by_shard: dict[str, list[DistilledSequence]] = {}
        for s in seqs:
            if str(s.id) not in index:
                raise InputError(f"{cache}: no hidden states for prompt id {s.id}; run the distillation first")
            by_shard.setdefault(index[str(s.id)], []).append(s)
        for shard, members in by_shard.items():
            with safe_open(str(cache / "hidden" / shard), framework="pt") as st:
                for s in members:
                    s.hidden = st.get_tensor(f"h.{s.id}")
                    if s.hidden.shape[0] != s.tokens.numel():
                        raise InputError(f"{cache}: hidden states of id {s.id} have {s.hidden.shape[0]} rows for "
                                         f"{s.tokens.numel()} tokens; delete the cache and distill again")
    return DistilledData(seqs, cache, meta)
