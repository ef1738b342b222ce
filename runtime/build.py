"""From command-line choices to a ready engine: load the models, then either open a compiled artifact
directory or build graphs on demand with a backend; and `specair compile`'s ahead-of-time build."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specair.compile.artifacts import (ArtifactError, GraphSet, compile_artifacts, load_artifacts, quantization,
                                       read_manifest, tokenizer_fingerprint, versions)
from specair.compile.backends import BackendUnavailable, get_backend
from specair.compile.catalog import Catalog
from specair.compile.plan import VARIANTS, Plan
from specair.compile.spec_config import SpeculativeConfig
from specair.models.checkpoint import check_memory, load_checkpoint
from specair.models.errors import InputError
from specair.models.llama import TensorParallel, Transformer, build_model, release_compiled_weights, with_features
from specair.runtime.engine import Engine
from specair.runtime.native_manifest import write_native
from specair.runtime.output import eos_ids
from specair.runtime.proposers import parse_config, proposer_class

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Models:
    target: Transformer
    tokenizer: Any
    draft: Transformer | None
    fingerprints: dict[str, Any]
    lazy: bool = False  # linear weights not read (placeholders): fit for graphs that read their own copies only


def load_model(path: str | None, dtype: str, tp: TensorParallel | None = None,
               lazy: bool = False) -> tuple[Transformer, Any, str]:
    """A model (with `tp`, this rank's shard, of which it reads only its part), its tokenizer (None for
    checkpoints without one) and its weights' fingerprint. `lazy`: its linear weights are placeholders,
    never read (`load_checkpoint`'s lazy_linear), for compiled graphs that hold their own copies."""
    t0 = time.perf_counter()
    if tp is None and not lazy:
        check_memory(path, DTYPES[dtype])
    ckpt = load_checkpoint(path, dtype=DTYPES[dtype], shard=None if tp is None else (tp.rank, tp.world),
                           lazy_linear=lazy)
    model = build_model(ckpt.config, ckpt.state_dict, DTYPES[dtype], tp, stored=ckpt.stored)
    log(f"loaded {ckpt.source} ({ckpt.config.model_type}, {ckpt.config.num_layers} layers, {dtype}) "
        f"in {time.perf_counter() - t0:.1f}s")
    return model, ckpt.tokenizer, ckpt.fingerprint


def load_models(path: str | None, dtype: str, spec: SpeculativeConfig | None, device: str = "cpu",
                features: tuple[int, ...] | None = None, tp: TensorParallel | None = None,
                lazy: bool = False) -> Models:
    """The target, its tokenizer and the model of the proposer the speculative config names (the proposer
    loads it: a draft checkpoint, the target's first layers, heads), all moved to `device`. `features`:
    the target's hidden output is the inputs of these layers and its final state (`with_features`), for
    distillation. With `tp`, this rank's shard of the target and of a draft model; heads stay whole on
    every rank, reading the target's sharded embedding and LM head. `lazy`: checkpoints' linear weights are
    not read (`load_model`): for opening compiled graphs that read their own copies, never for building them."""
    lazy = lazy and tp is None
    target, tokenizer, fp = load_model(path, dtype, tp, lazy)
    fingerprints: dict[str, Any] = {"target": fp, "tokenizer": tokenizer_fingerprint(tokenizer), "dtype": dtype}
    if features is not None:
        target = with_features(target, tuple(features), final=True)
        fingerprints["features"] = list(target.feature_layers)
    draft = None
    if spec is not None:
        draft, draft_fp = proposer_class(spec.method).load(spec, target, tokenizer, path,
                                                           lambda p: load_model(p, dtype, tp, lazy))
        if draft_fp is not None:
            fingerprints["draft"] = draft_fp
        target = proposer_class(spec.method).target_view(target, draft)
    if tp is not None:
        fingerprints["tensor_parallel"] = [tp.rank, tp.world, "shm" if tp.shm is not None else "group"]
    if device != "cpu":
        target = target.to(device)
        draft = draft.to(device) if draft is not None else None
    return Models(target, tokenizer, draft, fingerprints, lazy)


def parse_spec(spec_json: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """Parse --speculative-config (see `runtime.proposers.parse_config`); "none" is plain decoding, and
    "auto" is resolved against the backend by `open_engine` (`auto_spec`)."""
    if spec_json in (AUTO, "none"):
        return None
    return parse_config(spec_json)


def make_proposer(plan: Plan, target: Transformer, draft: Any) -> Any:
    """The proposer the plan names (None for a plan without speculation)."""
    spec = plan.speculative
    return proposer_class(spec.method)(spec, plan, target, draft) if spec is not None else None


def make_engine(target: Transformer, tokenizer: Any, draft: Any, graphs_for: Any, plan: Plan,
                max_waiting: int, model_name: str = "specair") -> Engine:
    """The proposer the plan names, its catalogue and graphs (`graphs_for(catalog)`), and the engine."""
    if plan.speculative is not None:
        target = proposer_class(plan.speculative.method).target_view(target, draft)
    proposer = make_proposer(plan, target, draft)
    graphs = graphs_for(Catalog(target, plan, proposer))
    return Engine(target, tokenizer, proposer, graphs, max_waiting=max_waiting, model_name=model_name)


def _device(backend: Any, device: str | None) -> str:
    """The device models and tensors live on: `device` if given (checked against the backend), else the
    backend's own."""
    if device is None:
        return backend.device
    if torch.device(device).type != torch.device(backend.device).type and backend.name != "eager":
        raise InputError(f"--device {device}: the {backend.name} backend runs on {backend.device}")
    return device


def _plan(target: Transformer, spec: SpeculativeConfig | None, max_context: int | None, dtype: str, *,
          backend: Any = None, draft: Any = None, **kw: Any) -> Plan:
    """The plan; with one context bucket where every graph's attention reads only the used cache slots
    (onnxruntime's fused attention covers one-row graphs and one-token steps, not a draft's steps over
    earlier drafted tokens), so more buckets would only be identical graphs to compile. Where graphs are
    cheap to have (eager: none compiled; one context bucket), smaller prefill chunks too
    (PREFILL_CHUNK_MIN up to prefill_chunk, doubling), so short prompts compute little padding."""
    cfg = target.config
    length_aware = (getattr(backend, "fuse_attention", False) and draft is None
                    and (spec is None or tuple(kw.get("batch_buckets", (1,))) == (1,)))
    if length_aware or backend is None or backend.name == "eager":
        top, chunks, c = kw.get("prefill_chunk", Plan.prefill_chunk), [], PREFILL_CHUNK_MIN
        while c < top:
            chunks.append(c)
            c *= 2
        kw.setdefault("prefill_chunks", tuple(chunks))
    plan = Plan(max_context=min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings),
                speculative=spec, dtype=dtype, context_buckets=not length_aware, **kw)
    longest_step = max([plan.prefill_chunk] + [t.num_nodes for t in plan.trees])
    if length_aware and target.rope_cos.shape[0] < plan.slots + longest_step:
        # The fused kernel does not apply (its RoPE table must cover the cache plus a step): attention would
        # read the whole cache at every step, so read it by context bucket.
        plan = dataclasses.replace(plan, context_buckets=True)
    return plan


def _log_spec(plan: Plan, backend: str) -> None:
    if plan.speculative is not None:
        s = plan.speculative
        log(f"speculating with {s.method} (k={s.num_speculative_tokens}, tree={s.tree or 'chain'}, "
            f"acceptance={s.acceptance}, backend={backend})")
        if s.adaptive:
            arms = "; ".join(f"k={c.num_speculative_tokens} tree={c.tree or 'chain'}" for c in s.shape_configs())
            log(f"adaptive: each greedy step runs plain decoding or one of [{arms}], by measured tokens/s")


PREFILL_CHUNK_MIN = 16
AUTO = "auto"
AUTO_MAX_CONTEXT = 2048  # the cached build's default context
# Plain decoding gets "plain" (temperature only) graphs of its own: the filtered variant's sort over the
# vocabulary costs more than the rest of a batched decode step. Speculative plans, with a graph per variant
# for every draft and verify shape, keep two (plain sampling rows run exactly on the filtered graphs).
AUTO_VARIANTS = ("greedy", "plain", "filtered")
AUTO_SPEC_VARIANTS = ("greedy", "filtered")


# What `--speculative-config auto` (the CLI's default) runs where speculation cannot change the output (the
# backend's graphs are row-independent, `Backend.row_independent`): prompt lookup, which needs no draft weights
# and runs a plain decode step wherever nothing in the context matches. Elsewhere auto is plain decoding.
AUTO_SPEC = {"method": "ngram"}


def auto_spec(be: Any, dtype: str, batch_buckets: tuple[int, ...]) -> SpeculativeConfig | None:
    """The speculative config `auto` means on this backend and plan (None: plain decoding)."""
    if not (be.row_independent and dtype == "fp32" and tuple(batch_buckets) == (1,)):
        return None
    log("specair: speculating by default, with n-gram prompt lookup: this path's graphs are row-independent, so "
        "the output is what plain decoding gives (--speculative-config none decodes plainly)")
    return parse_spec(AUTO_SPEC)


# Float checkpoints of at least this many parameters run int4 on `--backend auto`. A decode step of such a model
# is bound by reading its weights (float32 reads 6.4x the bytes of Q4_1), so int4 runs it several times faster,
# at a perplexity cost printed once (compile/quality.py); smaller checkpoints are toy and test models, whose
# step time is per-operator overhead whatever their weights, and which stay exactly the float model.
AUTO_INT4_MIN_PARAMS = 100_000_000


def auto_backend(model: str | None, quantize: str | None = None, dtype: str = "fp32") -> tuple[str, str | None]:
    """What `--backend auto` runs: onnxruntime where it is installed (else eager), with weights on specair's int4
    kernels: a GGUF file's quantized weights as it stores them (the default model's Q4_1 and Q8_0 included), and
    float checkpoints of AUTO_INT4_MIN_PARAMS parameters or more rounded onto Q4_1 (`--quantize` overrides).
    Other dtypes than fp32 run eager: the compiled path's kernels and its measurements are fp32's."""
    from specair.compile.backends.onnx import OnnxBackend
    from specair.models.checkpoint import describe

    if dtype != "fp32":
        return "eager", None
    try:  # the class's check: an instance would size onnxruntime's process-wide thread pool before --threads
        OnnxBackend.check_available()
    except BackendUnavailable:
        return "eager", None
    if quantize is not None:
        return "onnx", quantize
    info = describe(model)
    if info.quantized_types:
        log(f"specair: reading {'the default model' if model is None else Path(model).name}'s "
            f"{', '.join(sorted(info.quantized_types))} weights as stored, on specair's kernels")
        return "onnx", "int4"
    if info.num_params >= AUTO_INT4_MIN_PARAMS:
        log(f"specair: {Path(model).name} has {info.num_params / 1e6:.0f}M float parameters: running its linear "
            "layers as int4 (Q4_K's shape where K allows, else Q4_1) on specair's kernels (--quantize none keeps "
            "float32; the quality cost is measured once, when its graphs are built)")
        return "onnx", "int4"
    return "onnx", None


def cached_artifacts(models: Models, plan: Plan, backend: Any, *, progress: bool = True,
                     reload: Any = None) -> tuple[Path, dict[str, Any], Models]:
    """The artifact directory of this (models, plan, backend) in specair's cache, compiled once (with a
    progress bar) and reused by every later run; rebuilt when its manifest no longer matches (another
    specair, onnxruntime or torch; changed weights). Lazily loaded models (`Models.lazy`) cannot be compiled:
    `reload()` loads them whole first. Returns the directory, its manifest and the models."""
    import hashlib

    from specair.models.default_model import cache_dir, cache_lock

    key = {"fingerprints": models.fingerprints, "plan": plan.to_json(), "backend": backend.name,
           "quantization": quantization(backend), "versions": versions(backend)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    art = cache_dir() / "artifacts" / f"{backend.name}-{digest}"
    with cache_lock(f"artifacts-{digest}"):
        try:
            return art, read_manifest(art), models
        except ArtifactError:
            pass
        if models.lazy:
            if reload is None:
                raise ArtifactError(f"{art} is missing and the models were loaded without their linear weights")
            models = reload()
        catalog = Catalog(models.target, plan, make_proposer(plan, models.target, models.draft))
        log(f"specair: compiling {len(catalog.keys())} {backend.name} graphs once into {art} (later runs load "
            f"them; `specair compile` builds other plans)")
        t0 = time.perf_counter()
        compile_artifacts(catalog, backend, art, models.fingerprints, progress=progress)
        log(f"specair: compiled in {time.perf_counter() - t0:.0f}s")
        if getattr(backend.quantization, "method", None) == "int4":
            _report_int4_cost(models, art)
        return art, read_manifest(art), models


def _report_int4_cost(models: Models, art: Path) -> None:
    """Measure and print, once per build, what int4 costs the float weights it rounds (compile/quality.py)."""
    from specair.compile.quality import int4_cost

    t0 = time.perf_counter()
    cost = int4_cost(models.target, models.tokenizer)
    if cost is None:
        return
    (art / "quality.json").write_text(json.dumps(cost, indent=2) + "\n")
    log(f"specair: int4 quality cost, measured once ({time.perf_counter() - t0:.0f}s): perplexity "
        f"{cost['perplexity_int4']:.2f} against {cost['perplexity_float']:.2f} with the float weights "
        f"({cost['tokens']} tokens of a shipped public-domain text; {art / 'quality.json'})")


def open_engine(model: str | None = None, dtype: str = "fp32", spec_json: str | dict | None = None,
                backend: str | None = None, artifacts: str | None = None, max_context: int | None = None,
                threads: int | None = None, batch_buckets: tuple[int, ...] = (1,), max_waiting: int = 64,
                model_name: str | None = None, quantize: str | None = None, device: str | None = None,
                features: tuple[int, ...] | None = None, tensor_parallel_size: int = 1,
                tp: TensorParallel | None = None) -> Engine:
    """An engine from an artifact directory (compiling nothing), or with graphs built on first use by
    `backend` (eager by default) for the given batch buckets. `quantize` (onnx only: "int4", "int8") is
    weight-only quantization; with artifacts, None means whatever they were compiled with. Models and
    every graph input live on `device` (default: the backend's). `features`: the target's graphs output the
    inputs of these layers and the final hidden state (see `load_models`), which distillation records.

    `backend="auto"` (the CLI's default for generate and chat) is the fastest configuration here
    (`auto_backend`), built ahead of time into specair's cache on first use and loaded afterwards
    (`cached_artifacts`); its context defaults to AUTO_MAX_CONTEXT. `spec_json="auto"` (the CLI's default
    too) speculates where that cannot change the output (`auto_spec`); "none" or None decodes plainly.

    `tensor_parallel_size` N > 1 starts N-1 worker processes and returns rank 0's engine, which drives them
    (runtime/tensor_parallel); `tp` is the rank an engine is built for inside such a group."""
    spec = parse_spec(spec_json)
    spec_auto = spec_json == AUTO
    name = model_name or (Path(model).name if model else "SmolLM2-135M-Instruct")
    if tensor_parallel_size != 1 and tp is None:
        return _tensor_parallel_engine(dict(
            model=model, dtype=dtype, spec_json=spec_json, backend=backend, artifacts=artifacts,
            max_context=max_context, threads=threads, batch_buckets=tuple(batch_buckets), max_waiting=max_waiting,
            model_name=name, quantize=quantize, device=device, features=features), tensor_parallel_size)
    if tp is not None:
        return _rank_engine(model, dtype, spec, backend, max_context, threads, tuple(batch_buckets), max_waiting,
                            name, quantize, device, tp)
    if artifacts is None and backend == AUTO:
        backend, quantize = auto_backend(model, quantize, dtype)
        if backend != "eager":
            be = get_backend(backend, threads, quantize=quantize)
            spec = auto_spec(be, dtype, batch_buckets) if spec_auto else spec
            # graphs that read their own weight copies open from the cache without the float weights
            load = lambda lazy: load_models(model, dtype, spec, _device(be, device), features,  # noqa: E731
                                            lazy=lazy and be.reads_own_weights)
            models = load(True)
            plan = _plan(models.target, spec, max_context or AUTO_MAX_CONTEXT, dtype, backend=be, draft=models.draft,
                         batch_buckets=batch_buckets,
                         variants=AUTO_VARIANTS if spec is None else AUTO_SPEC_VARIANTS)
            art, manifest, models = cached_artifacts(models, plan, be, reload=lambda: load(False))
            return _artifact_engine(models, plan, be, art, manifest, f"remove {art} (specair rebuilds it)",
                                    max_waiting, name)
    if artifacts is None:
        be = get_backend(backend or "eager", threads, quantize=quantize)
        spec = auto_spec(be, dtype, batch_buckets) if spec_auto else spec
        models = load_models(model, dtype, spec, _device(be, device), features)
        plan = _plan(models.target, spec, max_context, dtype, backend=be, draft=models.draft,
                     batch_buckets=batch_buckets, variants=VARIANTS)
        if be.name != "eager":
            log(f"specair: no --artifacts given: graphs are compiled with {be.name} as they are first needed")
        _log_spec(plan, be.name)
        return make_engine(models.target, models.tokenizer, models.draft, lambda cat: GraphSet(cat, be, None, True),
                           plan, max_waiting, name)
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
    models = load_models(model, plan.dtype, plan.speculative, _device(be, device), features,
                         lazy=getattr(be, "reads_own_weights", False))
    return _artifact_engine(models, plan, be, art, manifest, compile_command(model, plan, be.name, art, quantize),
                            max_waiting, name)


# What `--backend auto` runs tensor-parallel (onnxruntime has no collectives): eager, which starts at once; inductor
# decodes faster but builds each rank layout's graphs for minutes first and traces them at every start.
TP_AUTO_BACKEND = "eager"


def _tensor_parallel_engine(kwargs: dict[str, Any], world: int) -> Engine:
    """Rank 0's engine over `world` ranks, its workers started with the same arguments."""
    from specair.runtime import tensor_parallel

    if world < 1:
        raise InputError(f"--tensor-parallel-size must be >= 1, got {world}")
    if kwargs["artifacts"] is not None:
        raise InputError("--artifacts cannot be combined with --tensor-parallel-size: each rank compiles its own "
                         "shard's graphs into specair's cache; pass --backend instead")
    if kwargs["features"] is not None:
        raise InputError("recording features (distillation) runs on one process; drop --tensor-parallel-size")
    backend = TP_AUTO_BACKEND if kwargs["backend"] == AUTO else kwargs["backend"] or "eager"
    cls = type(get_backend(backend, kwargs["threads"], quantize=kwargs["quantize"]))
    if not cls.tensor_parallel:
        raise InputError(f"the {backend} backend cannot run tensor-parallel: {cls.tensor_parallel_why}; use "
                         f"--backend eager or inductor on CPU (cuda or npu on accelerators)")
    device = kwargs["device"] or cls.device
    torchrun = tensor_parallel.torchrun_env()
    if kwargs["threads"] is None and torch.device(device).type == "cpu":  # the ranks share this machine's cores
        kwargs["threads"] = max(1, (os.cpu_count() or 1) // (torchrun["local_world"] if torchrun else world))
    kwargs["backend"] = backend
    build = lambda tp: open_engine(**kwargs, tp=tp)  # noqa: E731
    if torchrun is not None:  # every rank runs this same command; rank 0 drives
        return tensor_parallel.join(world, device, build, os.environ.get("SPECAIR_TP_TRACE"))
    log(f"specair: tensor parallelism over {world} ranks ({tensor_parallel.collectives(device)}, {backend})")
    return tensor_parallel.launch(world, device, kwargs, build)


def _rank_engine(model: str | None, dtype: str, spec: SpeculativeConfig | None, backend: str | None,
                 max_context: int | None, threads: int | None, batch_buckets: tuple[int, ...], max_waiting: int,
                 name: str, quantize: str | None, device: str | None, tp: TensorParallel) -> Engine:
    """One rank's engine over its shard; compiled backends build every graph before the first step, since a
    rank compiling mid-step would stall the others past the collective timeout."""
    if threads:
        torch.set_num_threads(threads)
    be = get_backend(backend or "eager", threads, quantize=quantize)
    device = device or be.device
    if torch.device(device).type != "cpu":
        device = f"{torch.device(device).type}:{tp.rank}"
    models = load_models(model, dtype, spec, _device(be, device), None, tp)
    compiled = be.name != "eager"
    plan = _plan(models.target, spec, max_context or (AUTO_MAX_CONTEXT if compiled else None), dtype, backend=be,
                 draft=models.draft, batch_buckets=batch_buckets,
                 variants=VARIANTS if not compiled else AUTO_VARIANTS if spec is None else AUTO_SPEC_VARIANTS)
    if tp.rank == 0:
        _log_spec(plan, be.name)
    if not compiled:
        engine = make_engine(models.target, models.tokenizer, models.draft,
                             lambda cat: GraphSet(cat, be, None, True), plan, max_waiting, name)
    else:
        art, manifest, models = cached_artifacts(models, plan, be, progress=tp.rank == 0)
        engine = _artifact_engine(models, plan, be, art, manifest, f"remove {art} (specair rebuilds it)",
                                  max_waiting, name)
        engine.graphs.load_pending()
    engine.prefix_cache = None  # every rank would have to make the same hits
    return engine


def _artifact_engine(models: Models, plan: Plan, be: Any, art: Path, manifest: dict[str, Any], hint: str,
                     max_waiting: int, name: str) -> Engine:
    """An engine over a checked artifact directory; its graphs load as they are first called."""
    t0 = time.perf_counter()
    engine = make_engine(models.target, models.tokenizer, models.draft,
                         lambda cat: load_artifacts(cat, be, art, manifest, models.fingerprints, hint),
                         plan, max_waiting, name)
    q = (manifest.get("quantization") or {}).get("method")
    if getattr(be, "reads_own_weights", False):  # memory follows the work: the graphs hold their own copies
        freed = sum(release_compiled_weights(m) for m in (models.target, models.draft) if isinstance(m, torch.nn.Module))
        if freed:
            log(f"specair: released {freed / 2**20:.0f} MiB of float weights the compiled graphs do not read")
    log(f"opened {len(manifest['graphs'])} {be.name} graphs from {art} in {time.perf_counter() - t0:.1f}s")
    _log_spec(plan, f"{be.name}{' ' + q if q else ''}")
    return engine


def engine_from_models(target: Transformer, tokenizer: Any = None, draft: Any = None,
                       spec: SpeculativeConfig | dict | str | None = None, *, max_context: int | None = None,
                       prefill_chunk: int = 128, batch_buckets: tuple[int, ...] = (1,), backend: str = "eager",
                       variants: tuple[str, ...] = VARIANTS, max_waiting: int = 64,
                       quantize: str | None = None) -> Engine:
    """An engine over models already in memory, on their device (graphs built on first use by `backend`,
    with weight-only `quantize` for onnx)."""
    be = get_backend(backend, quantize=quantize)
    plan = _plan(target, parse_spec(spec), max_context, next(k for k, v in DTYPES.items() if v == target.dtype),
                 backend=be, draft=draft, batch_buckets=batch_buckets, prefill_chunk=prefill_chunk, variants=variants)
    return make_engine(target, tokenizer, draft, lambda cat: GraphSet(cat, be, None, True), plan, max_waiting)


def compile_command(model: str | None, plan: Plan, backend: str, out: Path, quantize: str | None = None) -> str:
    """The `specair compile` command line that rebuilds artifacts for this plan."""
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
    models = load_models(model, dtype, spec, be.device)
    plan = _plan(models.target, spec, max_context, dtype, backend=be, draft=models.draft, batch_buckets=buckets,
                 prefill_chunk=prefill_chunk, variants=variants)
    catalog = Catalog(models.target, plan, make_proposer(plan, models.target, models.draft))
    log(f"compiling {len(catalog.keys())} graphs with {be.name}: batch buckets {plan.batch_buckets}, "
        f"context buckets {plan.ctx_buckets}, variants {plan.variants}")
    t0 = time.perf_counter()
    graphs = compile_artifacts(catalog, be, Path(out), models.fingerprints)
    write_native(Path(out), catalog, be, models.tokenizer, eos_ids(models.target, models.tokenizer),
                 models.fingerprints, compile_command(model, plan, be.name, Path(out), quantize))
    log(f"compiled in {time.perf_counter() - t0:.1f}s into {out}")
    return graphs
