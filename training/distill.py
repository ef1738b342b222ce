"""Self-distillation: the target answers the prompt set with its own chat template (greedy) through the
fast batched engine (`--backend auto`), whose graphs also output the target's features at every position --
the inputs of EAGLE-3's layers and the final hidden state -- which are recorded as they are computed, so no
second pass over the sequences is needed.

Cache layout (default `$SPECAIR_CACHE/train/<target fingerprint[:16]>`):

    meta.json                   target, fingerprint, max_new_tokens, feature layers (other settings are refused)
    answers.jsonl               one record per prompt: id, split, category, prompt_ids, answer_ids, finish_reason
    hidden/shard-NNNNN.safetensors  tensor "h.<id>" [length - 1, F] float16: position p's features, the layer
                                inputs side by side, then the final hidden state (the last token is never fed)
    hidden/index.json           id -> shard file
    progress.json               prompts, generated tokens and seconds spent, summed over runs

It resumes: a shard of finished sequences is written atomically, then its index entries and answers, and
a rerun skips every prompt that has both.

The answers are what costs hours, so they can ship (`ship_answers`, `specair train distill --ship`):
`distilled/answers-<fingerprint[:16]>.jsonl.gz` in the package holds each prompt's answer token ids. A cache
that lacks an answer takes the shipped one when its prompt tokens match, and its features are then recorded
by one teacher-forced pass (prompt and answer prefilled through the same engine, no decoding), so features
stay data of the machine and never ship.
"""

from __future__ import annotations

import gzip
import json
import os
import time
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from collections.abc import Callable

import torch
from torch import Tensor
from tqdm import tqdm

from specair.models.errors import InputError
from specair.models.llama import Transformer
from specair.training.prompt_set import load_prompts

CACHE_FORMAT = 2
SHARD_SEQUENCES = 64  # sequences per hidden-state shard: a crash loses at most this many answers
SHIPPED = Path(__file__).parent / "distilled"


@lru_cache(maxsize=64)
def _shard(path: str):  # noqa: ANN202 (safetensors' handle type)
    from safetensors import safe_open

    return safe_open(path, framework="pt")


@dataclass
class DistilledSequence:
    """One prompt and the target's greedy answer, with the target's features over both (read from the
    cache when asked for, so a large set never sits in memory)."""

    id: int
    split: str
    category: str
    tokens: Tensor  # [L] int64: prompt then answer
    prompt_len: int
    shard: Path | None = None  # the hidden-state shard holding this sequence
    hidden_size: int = 0
    finish_reason: str = "stop"
    block: Tensor | None = None  # [L, F] float16 once read (or set by hand); the last row is zeros

    @property
    def answer_len(self) -> int:
        return int(self.tokens.numel()) - self.prompt_len

    def _block(self) -> Tensor:
        if self.block is not None:
            return self.block
        if self.shard is None:
            raise InputError(f"sequence {self.id}: no hidden states were loaded")
        rows = _shard(str(self.shard)).get_tensor(f"h.{self.id}")
        # Position L-1 is never fed to the target; a zero row keeps every position indexable.
        block = rows.new_zeros(rows.shape[0] + 1, rows.shape[1])
        block[:-1] = rows
        return block

    @property
    def hidden(self) -> Tensor:
        """[L, H] float16: the target's final hidden state at every position (what EAGLE-1 and Medusa read)."""
        return self._block()[:, -self.hidden_size:]

    @property
    def features(self) -> Tensor:
        """[L, n*H] float16: the inputs of the recorded feature layers, side by side (what EAGLE-3 reads)."""
        return self._block()[:, :-self.hidden_size]


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
        for key in ("format", "fingerprint", "max_new_tokens", "feature_layers"):
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


def _append_progress(cache: Path, prompts: int, tokens: int, seconds: float) -> None:
    f = cache / "progress.json"
    p = json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {"prompts": 0, "generated_tokens": 0,
                                                                        "seconds": 0.0}
    p = {"prompts": p["prompts"] + prompts, "generated_tokens": p["generated_tokens"] + tokens,
         "seconds": round(p["seconds"] + seconds, 1)}
    _atomic_write_text(f, json.dumps(p) + "\n")


def read_progress(cache: Path) -> dict:
    """What distillation has cost so far: prompts, generated tokens, seconds and their rates."""
    f = Path(cache) / "progress.json"
    if not f.is_file():
        return {}
    p = json.loads(f.read_text(encoding="utf-8"))
    s = max(p["seconds"], 1e-9)
    return {**p, "prompts_per_s": round(p["prompts"] / s, 2),
            "generated_tokens_per_s": round(p["generated_tokens"] / s, 1)}


def prompt_crc(ids: list[int]) -> int:
    """A checksum of prompt token ids: shipped answers carry it, so an answer never meets another prompt."""
    return zlib.crc32(json.dumps(ids).encode())


def ship_answers(cache: Path, dest: Path | None = None) -> Path:
    """Write a cache's answers (ids, prompt checksums, answer ids) into `dest` as
    `answers-<fingerprint[:16]>.jsonl.gz`, beside a `.json` with the settings and the distillation's cost
    (`dest` None: the package's `SHIPPED`)."""
    cache, dest = Path(cache), Path(dest or SHIPPED)
    meta = json.loads((cache / "meta.json").read_text(encoding="utf-8"))
    answers = read_answers(cache)
    dest.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"id": i, "prompt_crc": prompt_crc(a["prompt_ids"]), "answer_ids": a["answer_ids"],
                         "finish_reason": a["finish_reason"]}) + "\n" for i, a in sorted(answers.items())]
    out = dest / f"answers-{meta['fingerprint'][:16]}.jsonl.gz"
    out.write_bytes(gzip.compress("".join(lines).encode(), compresslevel=9, mtime=0))
    record = {k: meta[k] for k in ("format", "fingerprint", "max_new_tokens", "target")}
    out.with_suffix("").with_suffix(".json").write_text(json.dumps(
        {**record, "answers": len(lines), "progress": read_progress(cache)}, indent=2) + "\n", encoding="utf-8")
    return out


def shipped_answers(fingerprint: str, max_new_tokens: int, source: Path | None = None) -> dict[int, dict]:
    """The answers shipped (in `source`, default `SHIPPED`) for this target and answer length, by prompt id
    (empty when none match)."""
    f = Path(source or SHIPPED) / f"answers-{fingerprint[:16]}.jsonl.gz"
    info = f.with_suffix("").with_suffix(".json")
    if not (f.is_file() and info.is_file()):
        return {}
    meta = json.loads(info.read_text(encoding="utf-8"))
    if (meta.get("format"), meta.get("fingerprint"), meta.get("max_new_tokens")) != (
            CACHE_FORMAT, fingerprint, max_new_tokens):
        return {}
    return {(r := json.loads(line))["id"]: r for line in gzip.decompress(f.read_bytes()).splitlines()}


def _take_shipped(records: list[dict], answers: dict[int, dict], shipped: dict[int, dict], tokenizer,
                  cache: Path) -> int:
    """Append the shipped answers of records without a cached one (prompt tokens checked) to the cache."""
    new = []
    for r in records:
        got = shipped.get(r["id"])
        if got is None or r["id"] in answers:
            continue
        ids = tokenizer.encode_chat(r["messages"])
        if prompt_crc(ids) != got["prompt_crc"]:
            continue  # made for another prompt (the set or the template changed): answer it again
        new.append({"id": r["id"], "split": r["split"], "category": r["category"], "prompt_ids": ids,
                    "answer_ids": got["answer_ids"], "finish_reason": got["finish_reason"]})
    if new:
        with open(cache / "answers.jsonl", "a", encoding="utf-8") as f:
            f.writelines(json.dumps(a) + "\n" for a in new)
        answers.update({a["id"]: a for a in new})
    return len(new)


def answer_and_record(records: list[dict], cache: Path, llm: object, max_new_tokens: int,
                      answers: dict[int, dict] | None = None) -> None:
    """Let the target answer every record (greedy) through `llm`'s engine, recording its features at
    every position as the graphs compute them; writes shards of finished sequences as they complete.
    A record with an answer in `answers` is teacher-forced instead: prompt and answer go through the
    engine's prefill (one token generated, then dropped), which records the same features without decoding."""
    from safetensors.torch import save_file

    from specair.runtime.params import SamplingParams

    engine, answers = llm.engine, answers or {}
    hdir = cache / "hidden"
    hdir.mkdir(parents=True, exist_ok=True)
    index = _read_index(cache)
    shard_no = 1 + max((int(Path(n).stem.split("-")[1]) for n in set(index.values())), default=-1)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    forced = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rows: dict[str, list[Tensor]] = {}
    engine.hidden_observer = lambda rid, h: rows[rid].append(h.to(torch.float16, copy=True))
    pending: dict[str, tuple[dict, list[int], dict | None]] = {}
    finished: list[tuple[dict, Tensor, bool]] = []
    queue = list(records)
    t0, tokens = time.perf_counter(), 0
    bar = tqdm(total=len(records), desc="distill", unit="prompt", leave=False)

    def flush() -> None:
        nonlocal shard_no, finished, t0, tokens
        if not finished:
            return
        name = f"shard-{shard_no:05d}.safetensors"
        tmp = hdir / f".{name}.tmp"
        save_file({f"h.{a['id']}": h.contiguous() for a, h, _ in finished}, str(tmp))
        os.replace(tmp, hdir / name)
        index.update({str(a["id"]): name for a, _, _ in finished})
        _atomic_write_text(hdir / "index.json", json.dumps(index) + "\n")
        with open(cache / "answers.jsonl", "a", encoding="utf-8") as f:
            f.writelines(json.dumps(a) + "\n" for a, _, new in finished if new)
        _append_progress(cache, sum(new for _, _, new in finished), tokens, time.perf_counter() - t0)
        t0, tokens, shard_no, finished = time.perf_counter(), 0, shard_no + 1, []

    try:
        while queue or engine.has_unfinished():
            while queue and engine.num_waiting < engine.max_waiting:
                rec = queue.pop(0)
                ids = llm.encode_chat(rec["messages"])
                known = answers.get(rec["id"])
                if known is None:
                    rid = engine.add_request(ids, params)
                else:  # the last answer token is never fed: its features are not needed
                    rid = engine.add_request(ids + known["answer_ids"][:-1], forced)
                rows[rid], pending[rid] = [], (rec, ids, known)
            for ev in engine.step():
                if ev.result is None:
                    continue
                rec, ids, known = pending.pop(ev.request_id)
                answer = list(ev.result.token_ids) if known is None else known["answer_ids"]
                h = torch.cat(rows.pop(ev.request_id))[:len(ids) + len(answer) - 1]
                if h.shape[0] != len(ids) + len(answer) - 1:
                    raise RuntimeError(f"prompt {rec['id']}: recorded {h.shape[0]} positions for "
                                       f"{len(ids) + len(answer)} tokens")
                finished.append(({"id": rec["id"], "split": rec["split"], "category": rec["category"],
                                  "prompt_ids": ids, "answer_ids": answer,
                                  "finish_reason": ev.result.finish_reason if known is None
                                  else known["finish_reason"]}, h, known is None))
                tokens += len(answer) if known is None else 0
                bar.update(1)
                if len(finished) >= SHARD_SEQUENCES:
                    flush()
        flush()
    finally:
        engine.hidden_observer = None
        bar.close()


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


def distill(model: Transformer, fingerprint: str, target_path: str | None, *, cache: Path | None = None,
            prompts_path: str | Path | None = None, extra_records: list[dict] | None = None,
            max_prompts: int | None = None,
            max_new_tokens: int = 256, make_llm: Callable[[], object] | None = None, gen_batch: int = 16,
            tokenizer: object | None = None, feature_layers: tuple[int, ...] | None = None) -> DistilledData:
    """Build (or resume, or just load) the distilled set for the first `max_prompts` prompts and return it.

    model: the target loaded from `target_path` (None: the default model); prompts_path: the prompt set
    (None: the shipped one), extra_records: more prompt records after it (self-generated ones; ids must not
    repeat); make_llm: builds the `specair.LLM`
    that answers and records (default: `--backend auto` over batch buckets up to `gen_batch`, recording
    `feature_layers`, EAGLE-3's defaults when None); tokenizer: the target's, to check that cached answers
    belong to these prompts. Splits and categories come from the prompt records, not from the cache."""
    from specair.models.eagle3 import default_feature_layers

    cache = Path(cache) if cache is not None else default_cache_dir(fingerprint)
    records = load_prompts(prompts_path) + list(extra_records or [])
    if len({r["id"] for r in records}) != len(records):
        raise InputError("the prompt sets share record ids; give each set its own ids")
    records = select_prompts(records, max_prompts)
    layers = tuple(feature_layers or default_feature_layers(model.config.num_layers))
    _check_meta(cache, {"format": CACHE_FORMAT, "fingerprint": fingerprint, "max_new_tokens": max_new_tokens,
                        "feature_layers": list(layers), "hidden_size": model.config.hidden_size,
                        "target": target_path or "default"})
    t0 = time.perf_counter()
    if make_llm is None:
        def make_llm():
            from specair.runtime.llm import LLM

            buckets = tuple(b for b in (1, 4, 16, 64) if b < gen_batch) + (gen_batch,)
            # The context only needs the longest prompt plus the answer: smaller caches, smaller buckets.
            longest = max(len(tokenizer.encode_chat(r["messages"])) for r in records) if tokenizer is not None else 1024
            return LLM(target_path, backend="auto", batch_buckets=buckets, max_waiting=4 * gen_batch,
                       max_context=min(model.config.max_position_embeddings, longest + max_new_tokens + 1),
                       features=layers)
    done_answers, index = read_answers(cache), _read_index(cache)
    taken = 0
    if tokenizer is not None:
        _check_prompts(records, done_answers, tokenizer, cache)
        taken = _take_shipped(records, done_answers, shipped_answers(fingerprint, max_new_tokens), tokenizer, cache)
    todo = [r for r in records if r["id"] not in done_answers or str(r["id"]) not in index]
    if todo:
        forced = sum(r["id"] in done_answers for r in todo)
        print(f"distill: {len(records) - len(todo)} of {len(records)} prompts cached in {cache} ({taken} answers "
              f"taken from the shipped set); answering {len(todo) - forced}, teacher-forcing {forced}", flush=True)
        answer_and_record(todo, cache, make_llm(), max_new_tokens, done_answers)
    data = load_distilled(cache, [r["id"] for r in records])
    labels = {r["id"]: (r["split"], r["category"]) for r in records}
    for seq in data.sequences:
        seq.split, seq.category = labels[seq.id]
    data.meta["distill_seconds_this_run"] = round(time.perf_counter() - t0, 1)
    data.meta["shipped_answers_taken"] = taken
    data.meta["progress"] = read_progress(cache)
    return data


def load_distilled(cache: Path, ids: list[int] | None = None, with_hidden: bool = True) -> DistilledData:
    """Load the distilled set (all of it, or the records `ids`) from a cache dir; hidden states stay in the
    shards until a sequence's are asked for."""
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
                                      len(a["prompt_ids"]), finish_reason=a.get("finish_reason", "stop")))
    if with_hidden:
        index = _read_index(cache)
        H = int(meta.get("hidden_size", 0))
        for s in seqs:
            if str(s.id) not in index:
                raise InputError(f"{cache}: no hidden states for prompt id {s.id}; run the distillation first")
            s.shard, s.hidden_size = cache / "hidden" / index[str(s.id)], H
        want = (int(seqs[0].tokens.numel()), H * (len(meta["feature_layers"]) + 1)) if seqs else None
        if seqs and tuple(seqs[0]._block().shape) != want:
            raise InputError(f"{cache}: hidden states of id {seqs[0].id} have shape "
                             f"{tuple(seqs[0]._block().shape)}, expected {want}; delete the cache and distill again")
    return DistilledData(seqs, cache, meta)
