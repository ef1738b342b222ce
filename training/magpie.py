"""Self-generated prompts, Magpie-style (Xu et al. 2024, arXiv:2406.08464): the target's chat template cut
at the start of a user turn is a prefix after which the target writes a user request itself.

Each candidate i is fixed by (seed, i): a topic and a task kind pick a system prompt (Magpie's system-prompt
control) and sometimes the request's first words; the target samples the rest of the user turn. Candidates
are kept when they end their turn, pass the filters (length, language, repetition, template residue) and
are not duplicates of a kept prompt. Generation appends to a JSONL file a batch at a time and records how
many candidates it has tried, so an interrupted run resumes where it stopped and reproduces the same set.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specair.models.errors import InputError

FORMAT = 1
HELDOUT_EVERY = 10
GEN_BATCH = 64  # rows the default engine samples at once
ENGINES = ("eager-bf16", "eager-fp32", "auto-fp32")  # backend-dtype; auto-fp32 is the default model's int4 onnx
# Sets generated for the default model ship here (`prompts-s<seed>.jsonl.gz` + `progress-s<seed>.json`), so a
# training run starts from them instead of hours of sampling; a larger --count resumes where they stop.
SHIPPED = Path(__file__).parent / "magpie"
ID_BASE = 1_000_000  # magpie ids sit above the shipped set's

TOPICS = (
    "cooking and recipes", "baking", "nutrition", "fitness and exercise", "sleep", "mental health", "first aid",
    "personal finance", "investing", "small business", "marketing", "job interviews", "careers", "management",
    "public speaking", "email writing", "creative writing", "poetry", "screenwriting", "grammar", "learning languages",
    "English vocabulary", "world history", "ancient Rome", "the Second World War", "philosophy", "ethics",
    "psychology", "sociology", "economics", "law and contracts", "politics and government", "geography",
    "travel planning", "hiking and camping", "gardening", "houseplants", "home repair", "interior design",
    "cars and driving", "cycling", "pets and dogs", "cats", "parenting", "relationships", "etiquette", "weddings",
    "music theory", "playing the guitar", "film and television", "books and literature", "video games",
    "board games", "photography", "drawing and painting", "fashion", "astronomy", "physics", "chemistry",
    "biology", "genetics", "ecology", "climate and weather", "geology", "oceans", "medicine", "the human body",
    "arithmetic", "algebra", "geometry", "probability and statistics", "calculus", "logic puzzles",
    "Python programming", "JavaScript and web development", "SQL and databases", "C and C++", "Rust", "Java",
    "shell scripting and Linux", "git and version control", "data science", "machine learning",
    "computer networks", "cybersecurity", "algorithms and data structures", "spreadsheets", "mobile phones",
    "electronics", "robotics", "space exploration", "energy and electricity", "architecture", "sports",
    "football", "chess", "mythology", "religion and festivals", "education and studying", "productivity",
)

# kind -> (what the system prompt says users do, request openings: "" leaves the whole turn to the target)
TASKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "question": ("Users ask you questions about {topic}.", ("", "", "What", "Why", "How does", "Can you explain")),
    "howto": ("Users ask you how to do things related to {topic}, step by step.",
              ("", "How do I", "How can I", "What is the best way to", "Can you help me")),
    "advice": ("Users ask you for advice and recommendations about {topic}.", ("", "I", "What should I", "Any tips")),
    "writing": ("Users ask you to write texts about {topic}: emails, stories, poems, essays and posts.",
                ("", "Write", "Can you write", "Draft")),
    "explain": ("Users ask you to explain concepts of {topic} simply, with examples.",
                ("", "Explain", "What is", "Describe")),
    "code": ("You are a programming assistant. Users ask you to write, fix or explain code, here about {topic}.",
             ("", "Write a Python function", "How do I", "Write a program", "Explain")),
    "math": ("Users give you math and reasoning problems, here about {topic}. Problems state all their numbers.",
             ("", "If", "Calculate", "Solve", "A")),
    "edit": ("Users give you a text about {topic} to summarize, rewrite, correct or translate, and include the text.",
             ("", "Summarize", "Rewrite", "Translate", "Correct")),
    "compare": ("Users ask you to compare things and list options about {topic}.",
                ("", "What is the difference between", "Compare", "List", "Give me")),
    "chat": ("You chat with users about {topic}.", ("", "", "Hi", "I")),
}

RESIDUE = ("<|", "|>", "assistant\n", "\nuser", "user:", "assistant:", "system:", "[INST]", "###")


@dataclass(frozen=True)
class MagpieSettings:
    """What fixes a generated set: its size, the seed and the sampling of user turns."""

    count: int = 20000
    seed: int = 0
    temperature: float = 0.7  # plain temperature sampling, no nucleus: its graphs skip the vocabulary sort
    top_p: float = 1.0
    max_tokens: int = 128  # longest user turn; one cut off there is dropped
    min_words: int = 3
    # The engine that samples the turns (backend-dtype). Its kernels decide the samples, so it fixes the set too.
    # The default is the one the shipped set was made with, so training starts from it; `auto-fp32` (the int4
    # onnx graphs, 32 rows) samples faster.
    engine: str = "eager-bf16"


def candidate(settings: MagpieSettings, i: int) -> dict[str, Any]:
    """The conditioning of candidate i: topic, task kind, system prompt and opening words."""
    rng = random.Random(f"{settings.seed}:{i}")
    topic = rng.choice(TOPICS)
    kind = rng.choice(tuple(TASKS))
    system, openings = TASKS[kind]
    return {"topic": topic, "kind": kind, "system": "You are a helpful AI assistant. " + system.format(topic=topic),
            "opening": rng.choice(openings)}


def user_turn_prefix(tokenizer: Any, system: str) -> str:
    """The chat template's text up to where a user turn's content starts, after `system`."""
    marker = "\x00MAGPIE\x00"
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": marker}],
                                         add_generation_prompt=False)
    if marker not in text:
        raise InputError("the chat template drops the user turn's content; Magpie prompts need a chat model")
    return text.split(marker)[0]


_WORD = re.compile(r"[A-Za-z0-9']+")


def normalize(text: str) -> str:
    """Lower-cased words only: the key two prompts are duplicates under."""
    return " ".join(_WORD.findall(text.lower()))


def reject_reason(text: str, finish_reason: str, settings: MagpieSettings) -> str | None:
    """Why a generated user turn is dropped, or None to keep it."""
    if finish_reason != "stop":
        return "unfinished"
    t = text.strip()
    words = _WORD.findall(t)
    if len(words) < settings.min_words:
        return "short"
    if any(r in t for r in RESIDUE):
        return "template"
    if sum(ch.isascii() for ch in t) < 0.98 * len(t):
        return "language"
    letters = sum(ch.isalpha() for ch in t)
    if letters < 0.5 * sum(not ch.isspace() for ch in t):
        return "language"
    low = [w.lower() for w in words]
    if len(low) >= 12:
        trigrams = Counter(zip(low, low[1:], low[2:]))
        if trigrams.most_common(1)[0][1] > 2 or len(set(low)) < 0.4 * len(low):
            return "repetition"
    if re.search(r"(.)\1{9,}", t):
        return "repetition"
    return None


class PromptFile:
    """The generated set on disk: `prompts.jsonl` (kept records) and `progress.json` (settings, candidates
    tried, rejection counts), next to each other."""

    def __init__(self, directory: Path, settings: MagpieSettings, fingerprint: str) -> None:
        self.dir, self.settings = Path(directory), settings
        self.path, self.progress_path = self.dir / "prompts.jsonl", self.dir / "progress.json"
        want = {"format": FORMAT, "fingerprint": fingerprint, "seed": settings.seed,
                "temperature": settings.temperature, "top_p": settings.top_p, "max_tokens": settings.max_tokens,
                "min_words": settings.min_words, "engine": settings.engine}
        if not self.progress_path.is_file():
            self._seed_from_shipped(want)
        if self.progress_path.is_file():
            self.progress = json.loads(self.progress_path.read_text(encoding="utf-8"))
            for key, value in want.items():
                if self.progress.get(key) != value:
                    raise InputError(f"{self.dir} holds prompts generated with {key}={self.progress.get(key)!r}, "
                                     f"this run asks for {value!r}; pass another directory or delete it")
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.progress = {**want, "tried": 0, "kept": 0, "rejected": {}, "seconds": 0.0, "generated_tokens": 0}
        self.records = self._read()
        # A crash between appending records and saving progress leaves records past `kept`: drop them, the
        # candidates that made them run again.
        self.records = self.records[:self.progress["kept"]]
        self.seen = {normalize(r["messages"][0]["content"]) for r in self.records}

    def _seed_from_shipped(self, want: dict) -> None:
        """Start an empty directory from the shipped set made with the same settings (target included), if any."""
        import gzip

        records, progress = SHIPPED / f"prompts-s{want['seed']}.jsonl.gz", SHIPPED / f"progress-s{want['seed']}.json"
        if not (records.is_file() and progress.is_file()):
            return
        shipped = json.loads(progress.read_text(encoding="utf-8"))
        if any(shipped.get(k) != v for k, v in want.items()):
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self.records = [json.loads(line) for line in gzip.decompress(records.read_bytes()).splitlines()]
        self.progress = {**shipped, "shipped": shipped["kept"]}
        self.save([])

    def _read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line
                break
        return out

    def save(self, new: list[dict]) -> None:
        self.records += new
        tmp = self.path.with_name(".prompts.jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in self.records)
        os.replace(tmp, self.path)
        self.progress["kept"] = len(self.records)
        tmp = self.progress_path.with_name(".progress.json.tmp")
        tmp.write_text(json.dumps(self.progress, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, self.progress_path)


def generate_prompts(llm: Any, directory: Path, settings: MagpieSettings, fingerprint: str,
                     batch: int = 256) -> list[dict]:
    """Grow the set in `directory` to `settings.count` prompts (resuming a partial one) with `llm`
    (a specair.LLM over the target); returns the records, in the shipped set's record format."""
    from specair.runtime.params import SamplingParams

    store = PromptFile(directory, settings, fingerprint)
    tok = llm.tokenizer
    if tok is None:
        raise InputError("the target has no tokenizer (and no chat template); Magpie prompts need one")
    prefixes: dict[str, list[int]] = {}
    bar = tqdm(total=settings.count, initial=min(len(store.records), settings.count), desc="magpie prompts",
               unit="prompt")
    while len(store.records) < settings.count:
        t0 = time.perf_counter()
        first = store.progress["tried"]
        cands = [candidate(settings, i) for i in range(first, first + batch)]
        ids, openings = [], []
        for c in cands:
            if c["system"] not in prefixes:
                prefixes[c["system"]] = tok.encode(user_turn_prefix(tok, c["system"]), add_special_tokens=False)
            openings.append(tok.encode(c["opening"], add_special_tokens=False) if c["opening"] else [])
            ids.append(prefixes[c["system"]] + openings[-1])
        params = [SamplingParams(max_tokens=settings.max_tokens, temperature=settings.temperature,
                                 top_p=settings.top_p, seed=settings.seed * 1_000_003 + first + j)
                  for j in range(len(cands))]
        results = llm.generate(ids, params)
        new, examined = [], 0
        for j, (c, res) in enumerate(zip(cands, results)):
            if len(store.records) + len(new) >= settings.count:
                break  # the rest stay untried, so a larger count resumes exactly here
            examined = j + 1
            # Decoded with the opening, so a word the target continues stays one word.
            text = tok.decode(openings[j] + list(res.token_ids)).strip()
            why = reject_reason(text, res.finish_reason, settings)
            key = normalize(text)
            if why is None and key in store.seen:
                why = "duplicate"
            if why is not None:
                store.progress["rejected"][why] = store.progress["rejected"].get(why, 0) + 1
                continue
            store.seen.add(key)
            n = len(store.records) + len(new)
            new.append({"id": ID_BASE + n, "messages": [{"role": "user", "content": text}],
                        "split": "heldout" if n % HELDOUT_EVERY == HELDOUT_EVERY - 1 else "train",
                        "category": c["kind"], "topic": c["topic"], "source": "magpie", "candidate": first + j})
        store.progress["tried"] = first + examined
        store.progress["generated_tokens"] += sum(r.num_generated_tokens for r in results[:examined])
        store.progress["seconds"] = round(store.progress["seconds"] + time.perf_counter() - t0, 1)
        store.save(new)
        bar.update(len(new))
        bar.set_postfix(tried=store.progress["tried"], kept=f"{len(store.records) / store.progress['tried']:.0%}",
                        tok_s=f"{store.progress['generated_tokens'] / max(store.progress['seconds'], 1e-9):.0f}")
    bar.close()
    return store.records[:settings.count]


def cached_prompts(directory: Path, settings: MagpieSettings, fingerprint: str) -> list[dict] | None:
    """The first `settings.count` prompts of a finished set in `directory` (or of the shipped set), or None if it
    holds fewer."""
    store = PromptFile(directory, settings, fingerprint)
    return store.records[:settings.count] if len(store.records) >= settings.count else None


def report(directory: Path) -> dict:
    """progress.json plus rates: what a training record cites about its prompts."""
    p = json.loads((Path(directory) / "progress.json").read_text(encoding="utf-8"))
    s = max(p["seconds"], 1e-9)
    return {**p, "prompts_per_s": round(p["kept"] / s, 2), "candidates_per_s": round(p["tried"] / s, 2),
            "generated_tokens_per_s": round(p["generated_tokens"] / s, 1)}


def ship(directory: Path, seed: int) -> Path:
    """Copy a generated set into the package (`SHIPPED`), compressed, beside its progress record."""
    import gzip

    directory = Path(directory)
    SHIPPED.mkdir(parents=True, exist_ok=True)
    progress = json.loads((directory / "progress.json").read_text(encoding="utf-8"))
    progress.pop("shipped", None)
    lines = (directory / "prompts.jsonl").read_bytes().splitlines(keepends=True)[:progress["kept"]]
    out = SHIPPED / f"prompts-s{seed}.jsonl.gz"
    out.write_bytes(gzip.compress(b"".join(lines), compresslevel=9, mtime=0))
    (SHIPPED / f"progress-s{seed}.json").write_text(json.dumps(progress, indent=2) + "\n", encoding="utf-8")
    return out


def default_dir(fingerprint: str, seed: int) -> Path:
    """Where `specair train prompts` keeps a target's generated set: beside its distillation caches."""
    from specair.training.distill import default_cache_dir

    return default_cache_dir(fingerprint) / f"magpie-s{seed}"


def open_llm(target: str | None, settings: MagpieSettings, batch: int, threads: int | None = None) -> Any:
    """The batched engine the target samples user turns with (`settings.engine`) over batch buckets up to
    `batch`."""
    from specair.runtime.llm import LLM

    backend, dtype = settings.engine.split("-")
    buckets = tuple(b for b in (1, 4, 16, 64) if b < batch) + (batch,)
    return LLM(target, backend=backend, dtype=dtype, batch_buckets=buckets, max_context=1024, threads=threads,
               max_waiting=4 * batch)
