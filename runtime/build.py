"""From command-line choices to a ready engine: load the models, then either open a compiled artifact
directory or build graphs on demand with a backend; and `specair compile`'s ahead-of-time build."""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specair.compile.artifacts import GraphSet, compile_artifacts, load_artifacts, read_manifest, tokenizer_fingerprint
from specair.compile.backends import get_backend
from specair.compile.catalog import Catalog
from specair.compile.plan import VARIANTS, Plan
from specair.compile.spec_config import HEAD_METHODS, SpeculativeConfig
from specair.models.checkpoint import load_checkpoint
from specair.models.errors import InputError
from specair.models.llama import Transformer, build_model, truncated
from specair.runtime.engine import Engine

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Models:
    target: Transformer
    tokenizer: Any
    draft: Transformer | None
    fingerprints: dict[str, Any]


def load_model(path: str | None, dtype: str) -> tuple[Transformer, Any, str]:
    """A model, its tokenizer (None for checkpoints without one) and its weights' fingerprint."""
    t0 = time.perf_counter()
    ckpt = load_checkpoint(path, dtype=DTYPES[dtype])
    model = build_model(ckpt.config, ckpt.state_dict, DTYPES[dtype])
    log(f"loaded {ckpt.source} ({ckpt.config.model_type}, {ckpt.config.num_layers} layers, {dtype}) "
        f"in {time.perf_counter() - t0:.1f}s")
    return model, ckpt.tokenizer, ckpt.fingerprint


SHIPPED_HEADS = {"eagle": "eagle", "medusa": "medusa"}


def shipped_head(method: str) -> Path:
    """The trained heads shipped for the default model (models/heads/)."""
    from specair import models

    path = Path(models.__file__).parent / "heads" / "smollm2-135m-instruct" / SHIPPED_HEADS[method]
    if not path.exists():
        raise InputError(f"no shipped {method} heads at {path}; pass 'model' in --speculative-config")
    return path


def _file_fingerprint(path: Path) -> str:
    files = sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file())
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def load_models(path: str | None, dtype: str, spec: SpeculativeConfig | None) -> Models:
    """The target, its tokenizer and the proposer the speculative config names: a draft model (refusing a
    vocabulary mismatch), the target's first layers, or heads on the target (shipped ones for the default
    model when no path is given). An n-gram proposer needs no model."""
    target, tokenizer, fp = load_model(path, dtype)
    fingerprints: dict[str, Any] = {"target": fp, "tokenizer": tokenizer_fingerprint(tokenizer), "dtype": dtype}
    draft = None
    if spec is None or spec.method == "ngram":
        pass
    elif spec.method == "layer_skip":
        draft = truncated(target, spec.num_layers)
        fingerprints["draft"] = f"layer_skip:{spec.num_layers}"
    elif spec.method == "draft_model":
        draft, draft_tok, fingerprints["draft"] = load_model(spec.model, dtype)
        if draft.config.vocab_size != target.config.vocab_size or (
                tokenizer is not None and draft_tok is not None
                and tokenizer.backend.get_vocab() != draft_tok.backend.get_vocab()):
            raise InputError(f"the draft model {spec.model} has a different tokenizer than the target; "
                             "a draft must share the target's vocabulary")
    else:
        if spec.model is None and path is not None:
            raise InputError(f"method {spec.method!r} needs 'model' (the heads' path): heads are shipped only "
                             "for the default model")
        head_path = Path(spec.model).expanduser() if spec.model else shipped_head(spec.method)
        if not head_path.exists():
            raise InputError(f"{head_path}: no such file or directory")
        if spec.method == "eagle":
            from specair.models.eagle import load_eagle as load
        elif spec.method == "medusa":
            from specair.models.medusa import load_medusa as load
        else:
            from specair.models.mlp_speculator import load_mlp_speculator as load
        draft = load(head_path, target)
        fingerprints["draft"] = f"{spec.method}:{_file_fingerprint(head_path)}"
        log(f"loaded {spec.method} heads from {head_path}")
    return Models(target, tokenizer, draft, fingerprints)


def parse_spec(spec_json: str | dict | None) -> SpeculativeConfig | None:
    """Parse --speculative-config. Heads may omit the lookahead and tree: they come from the heads'
    directory (`speculative.json`, which the shipped heads carry, else the head count in config.json)."""
    if spec_json is None:
        return None
    raw = spec_json
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise InputError(f"--speculative-config is not valid JSON: {e}") from None
    if isinstance(raw, dict) and raw.get("method") in HEAD_METHODS and "num_speculative_tokens" not in raw:
        raw = {**head_defaults(raw["method"], raw.get("model")), **raw}
    return SpeculativeConfig.parse(raw)


def head_defaults(method: str, model: str | None) -> dict[str, Any]:
    """The lookahead (and tree) a set of heads is meant to run with."""
    path = Path(model).expanduser() if model else shipped_head(method)
    folder = path if path.is_dir() else path.parent
    if (folder / "speculative.json").exists():
        return json.loads((folder / "speculative.json").read_text())
    cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
    n = cfg.get("medusa_num_heads") if method == "medusa" else cfg.get("n_predict")
    if not isinstance(n, int):
        raise InputError(f"method {method!r}: set 'num_speculative_tokens' (nothing in {folder} says how many)")
    return {"num_speculative_tokens": n}


def open_engine(model: str | None = None, dtype: str = "fp32", spec_json: str | dict | None = None,
                backend: str | None = None, artifacts: str | None = None, max_context: int | None = None,
                threads: int | None = None, batch_buckets: tuple[int, ...] = (1,), max_waiting: int = 64,
                model_name: str | None = None, quantize: str | None = None) -> Engine:
    """An engine from an artifact directory (compiling nothing), or with graphs built on first use by
    `backend` (eager by default) for the given batch buckets. `quantize` (onnx only: "int4", "int8") is
    weight-only quantization; with artifacts, None means whatever they were compiled with."""
    spec = parse_spec(spec_json)
    if artifacts is None:
        be = get_backend(backend or "eager", threads, quantize=quantize)
        models = load_models(model, dtype, spec)
        cfg = models.target.config
        plan = Plan(max_context=min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings),
                    batch_buckets=batch_buckets, variants=VARIANTS, speculative=spec, dtype=dtype)
        if be.name != "eager":
            log(f"specair: no --artifacts given: graphs are compiled with {be.name} as they are first needed")
        graphs = GraphSet(Catalog(models.target, plan, models.draft), be, None, lazy=True)
    else:
        art = Path(artifacts)
        manifest = read_manifest(art)
        plan = Plan.from_json(manifest["plan"])
        if backend is not None and backend != manifest["backend"]:
            raise InputError(f"--backend {backend} but {art} holds {manifest['backend']} artifacts")
        if spec is not None and spec != plan.speculative:
            raise InputError(f"--speculative-config differs from the one {art} was compiled for "
                             f"({plan.speculative}); omit it to use the compiled one, or recompile")
        if max_context is not None and max_context != plan.max_context:
            raise InputError(f"--max-context {max_context} differs from the compiled plan's {plan.max_context}")
        if quantize is None:
            quantize = (manifest.get("quantization") or {}).get("method")
        be = get_backend(manifest["backend"], threads, quantize=quantize)
        models = load_models(model, plan.dtype, plan.speculative)
        hint = compile_command(model, plan, be.name, art, quantize)
        t0 = time.perf_counter()
        graphs = load_artifacts(Catalog(models.target, plan, models.draft), be, art, manifest, models.fingerprints,
                                hint)
        log(f"loaded {len(graphs.fns)} {be.name} graphs from {art} in {time.perf_counter() - t0:.1f}s")
    if plan.speculative is not None:
        s = plan.speculative
        log(f"speculating with {s.method} (k={s.num_speculative_tokens}, tree={s.tree or 'chain'}, "
            f"acceptance={s.acceptance}, backend={graphs.backend.name})")
    name = model_name or (Path(model).name if model else "SmolLM2-135M-Instruct")
    return Engine(models.target, models.tokenizer, models.draft, graphs, max_waiting=max_waiting, model_name=name)


def engine_from_models(target: Transformer, tokenizer: Any = None, draft: Any = None,
                       spec: SpeculativeConfig | dict | str | None = None, *, max_context: int | None = None,
                       prefill_chunk: int = 128, batch_buckets: tuple[int, ...] = (1,), backend: str = "eager",
                       variants: tuple[str, ...] = VARIANTS, max_waiting: int = 64,
                       quantize: str | None = None) -> Engine:
    """An engine over models already in memory (graphs built on first use by `backend`, with weight-only
    `quantize` for onnx)."""
    cfg = target.config
    plan = Plan(max_context=min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings),
                batch_buckets=batch_buckets, prefill_chunk=prefill_chunk, variants=variants,
                speculative=parse_spec(spec) if not isinstance(spec, SpeculativeConfig) else spec,
                dtype=next(k for k, v in DTYPES.items() if v == target.dtype))
    graphs = GraphSet(Catalog(target, plan, draft), get_backend(backend, quantize=quantize), None, lazy=True)
    return Engine(target, tokenizer, draft, graphs, max_waiting=max_waiting)


def compile_command(model: str | None, plan: Plan, backend: str, out: Path, quantize: str | None = None) -> str:
    """The `specair compile` command line that rebuilds artifacts for this plan."""
    import dataclasses

    parts = ["specair", "compile", "--backend", backend, "--out", str(out), "--max-context", str(plan.max_context),
             "--buckets", ",".join(map(str, plan.batch_buckets)), "--variants", ",".join(plan.variants),
             "--dtype", plan.dtype]
    if model:
        parts += ["--model", model]
    if quantize not in (None, "none"):
        parts += ["--quantize", quantize]
    if plan.speculative:
        spec = {k: v for k, v in dataclasses.asdict(plan.speculative).items() if v is not None}
        parts += ["--speculative-config", json.dumps(spec)]
    return " ".join(shlex.quote(p) for p in parts)


def compile_plan(model: str | None, dtype: str, spec_json: str | None, backend: str, out: str,
                 buckets: tuple[int, ...], max_context: int | None, variants: tuple[str, ...],
                 prefill_chunk: int, threads: int | None, self_contained: bool = False,
                 quantize: str | None = None) -> GraphSet:
    """`specair compile`: every graph of the plan, ahead of time, into an artifact directory
    (`self_contained`: onnx files with their weights inside, for Ascend ATC)."""
    spec = parse_spec(spec_json)
    if self_contained and backend != "onnx":
        raise InputError("--self-contained applies to the onnx backend only")
    be = get_backend(backend, threads, quantize=quantize, **({"self_contained": True} if self_contained else {}))
    models = load_models(model, dtype, spec)
    cfg = models.target.config
    plan = Plan(max_context=min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings),
                batch_buckets=buckets, prefill_chunk=prefill_chunk, variants=variants, speculative=spec, dtype=dtype)
    catalog = Catalog(models.target, plan, models.draft)
    log(f"compiling {len(catalog.keys())} graphs with {be.name}: batch buckets {plan.batch_buckets}, "
        f"context buckets {plan.ctx_buckets}, variants {plan.variants}")
    t0 = time.perf_counter()
    graphs = compile_artifacts(catalog, be, Path(out), models.fingerprints)
    log(f"compiled in {time.perf_counter() - t0:.1f}s into {out}")
    return graphs
