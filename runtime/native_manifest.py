"""What the native runner (`specair-run`, runtime/native/) reads beside an artifact directory.

`native.json` makes the runner table-driven: every graph's named inputs (shape, dtype) and outputs, which
graph serves which step (by batch bucket, context bucket, sampling variant and speculative shape, as the
Python engine and its proposer name them), the proposer's protocol, the caches' shapes, the plan's
buckets, and each token's bytes for decoding text. For aoti artifacts, `weights.safetensors` holds every
constant the packages take from the live model (by the packages' constant names) and the few each package
owns (under `<graph>/<name>`); tied weights are stored once and aliased.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specair.compile.artifacts import source_digest, versions
from specair.compile.catalog import Catalog
from specair.compile.graph_def import GraphKey
from specair.models.errors import InputError

NATIVE = "native.json"
WEIGHTS = "weights.safetensors"
FORMAT = 1


def _io(catalog: Catalog, key: GraphKey) -> dict[str, Any]:
    g = catalog.graph(key)
    return {"inputs": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                       for n, t in zip(g.input_names, g.example_inputs)],
            "outputs": list(g.output_names)}


def _steps(catalog: Catalog, proposer: Any) -> list[dict[str, Any]]:
    """Which graphs run a decode or speculative step, for every bucket, variant and shape the plan has."""
    plan, out = catalog.plan, []
    for b in plan.batch_buckets:
        for c in plan.ctx_buckets:
            for v in plan.variants:
                out.append({"batch": b, "ctx": c, "variant": v, "shape": None,
                            "decode": GraphKey("decode", b, c, variant=v).name})
                for i in (plan.shapes(v) if plan.speculative else ()):
                    draft = proposer.draft_key(b, c, v, i)
                    out.append({"batch": b, "ctx": c, "variant": v, "shape": i,
                                "verify": catalog.verify_key(b, c, v, i).name,
                                "draft": draft.name if draft is not None else None,
                                "sync": GraphKey("draft_sync", b, c).name if proposer.has_cache else None})
    return out


def _proposer(proposer: Any) -> dict[str, Any] | None:
    if proposer is None:
        return None
    spec = proposer.spec
    if proposer.native is None:
        raise InputError(f"the native runner cannot drive method {spec.method!r}")
    return {"method": spec.method, "native": proposer.native, "offset": getattr(proposer, "offset", 0),
            "reads_hidden": getattr(proposer, "reads_hidden", False), "has_cache": proposer.has_cache,
            "prompt_lookup_min": spec.prompt_lookup_min, "prompt_lookup_max": spec.prompt_lookup_max,
            "acceptance": spec.acceptance, "disable_by_batch_size": spec.disable_by_batch_size,
            "adaptive": spec.adaptive}


def _cache(model: Any) -> dict[str, Any]:
    c = model.config
    return {"layers": c.num_layers, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "dtype": str(model.dtype).removeprefix("torch.")}


def _weights(catalog: Catalog, art_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The aoti packages' constants: model tensors by name (each storage once; the other names of a tied
    tensor as aliases) and each package's own under `<graph>/<name>`."""
    from specair.compile.backends.aoti import _module_tensors

    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    by_storage: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for key in catalog.keys():
        graph = catalog.graph(key)
        side = torch.load(art_dir / f"{key.name}.aoti.pt", map_location="cpu", weights_only=True)
        module = _module_tensors(graph)
        for fqn, spec in side["constants"].items():
            if spec["source"] == "package":
                tensors[f"{key.name}/{fqn}"] = side["tensors"][fqn].contiguous()
                continue
            if fqn in tensors or fqn in aliases:
                continue
            t = module[fqn].detach()
            if not t.is_contiguous():
                raise InputError(f"graph {key.name}: constant {fqn} is not contiguous; the native runner "
                                 "maps weights as stored")
            ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if ident in by_storage:
                aliases[fqn] = by_storage[ident]
            else:
                by_storage[ident] = fqn
                tensors[fqn] = t
    return tensors, aliases


def write_native(art_dir: Path, catalog: Catalog, backend: Any, tokenizer: Any, eos_ids: frozenset[int],
                 fingerprints: dict[str, Any], recompile: str) -> None:
    """Write native.json (and, for aoti, weights.safetensors) into a compiled artifact directory."""
    from safetensors.torch import save_file

    plan, target, proposer = catalog.plan, catalog.target, catalog.proposer
    vocab, decoding = None, None
    if tokenizer is not None:
        pieces, decoding = tokenizer.token_bytes(target.config.vocab_size)
        vocab = [b.hex() for b in pieces]
    caches = {"target": _cache(target)}
    if proposer is not None and proposer.has_cache:
        caches["draft"] = _cache(proposer.draft)
    prefill = [{"ctx": c, "chunk": t, "target": GraphKey("prefill", 1, c, chunk=plan.chunk_key(t)).name,
                "draft": GraphKey("draft_prefill", 1, c, chunk=plan.chunk_key(t)).name
                if proposer is not None and proposer.has_cache else None}
               for c in plan.ctx_buckets for t in plan.chunk_buckets]
    doc = {
        "format": FORMAT, "backend": backend.name, "versions": versions(backend), "fingerprints": fingerprints,
        "recompile": recompile,
        "model": {"vocab_size": target.config.vocab_size, "eos_token_ids": sorted(eos_ids),
                  "dtype": str(target.dtype).removeprefix("torch."), "feature_size": target.feature_size},
        "caches": caches,
        "plan": {"max_context": plan.max_context, "slots": plan.slots, "batch_buckets": list(plan.batch_buckets),
                 "ctx_buckets": list(plan.ctx_buckets), "chunk_buckets": list(plan.chunk_buckets),
                 "prefill_chunk": plan.prefill_chunk, "variants": list(plan.variants),
                 "depths": [t.depth for t in plan.trees], "max_depth": plan.max_depth},
        "proposer": _proposer(proposer),
        "prefill": prefill, "steps": _steps(catalog, proposer),
        "graphs": {k.name: _io(catalog, k) for k in catalog.keys()},
        "decoding": decoding, "vocab": vocab,
    }
    if backend.name == "aoti":
        tensors, aliases = _weights(catalog, art_dir)
        doc["aliases"] = aliases
        save_file(tensors, str(art_dir / (WEIGHTS + ".partial")), metadata={"source_digest": source_digest()})
        (art_dir / (WEIGHTS + ".partial")).replace(art_dir / WEIGHTS)
    (art_dir / NATIVE).write_text(json.dumps(doc, ensure_ascii=False))
