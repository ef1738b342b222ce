"""`specair bench`: autoregressive decoding and every speculative configuration, plus peers on the same
weights, measured in one process, interleaved prompt by prompt after a warm-up.

    specair bench [--prompts FILE.jsonl] [--configs FILE.json | --spec JSON ...] [--backends eager,...]
                  [--acceptance exact,greedy] [--max-tokens 128] [--batch-sizes 1,2,4] [--peers auto]
                  [--out DIR]

Without --configs or --spec it measures the main job (what `specair generate` runs with no flags: backend and
speculation `auto`) and its plain decoding on that backend, then autoregressive decoding, n-gram and the shipped
heads on --backends (eager by default; eager fp32 autoregressive is the reference row). Writes results.json
(every raw sample and the environment), results.md (the table) and PNG plots into --out. See benchmarks.report for the metrics and benchmarks.peers for the peers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Protocol

from specair.benchmarks.peers import (OPENVINO_PEERS, PEERS, TRANSFORMERS_PEERS, LlamaCppPeer, OpenVinoGenAIPeer,
                                      PeerUnavailable, TransformersPeer, peer_baseline, peer_engine)
from specair.benchmarks.report import (BatchRun, Entry, Sample, markdown_report, markdown_table, plot_all,
                                       summarize, write_json)
from specair.models.errors import InputError
from specair.runtime.build import AUTO
from specair.runtime.params import SamplingParams
from specair.runtime.prompts import read_prompt_file

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"  # package data, also in a wheel install
AUTOREGRESSIVE = "autoregressive"

# Used when neither --configs nor --spec is given: prompt lookup (needs no trained weights), and for the
# default model its shipped EAGLE and Medusa heads, each with the lookahead and tree the heads carry.
DEFAULT_SPECS: list[dict[str, Any]] = [{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}]
# What `specair generate` runs with no flags: `auto` backend and speculation, resolved as the engine resolves them.
MAIN_JOB: dict[str, Any] = {"speculative_config": "auto", "backend": "auto", "name": "main job (generate's defaults)"}


# ---------------------------------------------------------------- prompts


def load_prompt_set(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a prompt file (`runtime.prompts`), each with an "id" and a "category" ("" if it has none)."""
    out = [{"id": rec.get("id", f"prompt-{i + 1}"), "category": rec.get("category", ""), **rec}
           for i, (_, rec) in enumerate(read_prompt_file(path))]
    if not out:
        raise InputError(f"{path} holds no prompts")
    return out


def encode_prompt(rec: dict[str, Any], tokenizer: Any) -> list[int]:
    """Token ids of a prompt record: chat turns through the chat template, plain text as is."""
    if tokenizer is None:
        raise InputError("this checkpoint has no tokenizer; the benchmark needs one to encode its prompts")
    if "messages" in rec:
        return tokenizer.encode_chat(rec["messages"])
    return tokenizer.encode(rec["prompt"])


# ---------------------------------------------------------------- configurations


@dataclass(frozen=True)
class BenchConfig:
    """One specair configuration: backend × proposer (speculative config, None = autoregressive) × dtype, or
    an artifact directory from `specair compile` (its manifest fills in backend, dtype, proposer, quantization)."""

    speculative_config: dict[str, Any] | None = None
    backend: str = "eager"
    dtype: str = "fp32"
    artifacts: str | None = None
    name: str | None = None
    quantize: str | None = None  # weight-only quantization, as recorded in the artifacts' manifest
    tensor_parallel_size: int = 1
    model: str | None = None  # this configuration's checkpoint, when not the benchmark's --model

    @property
    def label(self) -> str:
        return self.name or config_name(self)

    @property
    def baseline_key(self) -> tuple[str, str, str | None, int, str | None]:
        """Configurations with the same key share an autoregressive baseline (same weights, arithmetic, backend
        and ranks)."""
        return (self.backend, self.dtype, self.quantize, self.tensor_parallel_size, self.model)


def config_name(cfg: BenchConfig) -> str:
    """A short readable name: method, lookahead, the other keys, then backend/dtype/quantization when not
    the defaults."""
    s = cfg.speculative_config
    if s is None:
        name = AUTOREGRESSIVE
    elif s == AUTO:
        name = "speculative auto"
    else:
        def show(k: str, v: Any) -> str:
            if k == "model":
                return Path(v).name
            return f"choices:{len(v)}" if k == "tree" and isinstance(v, list) else str(v)  # Medusa choice lists

        extra = " ".join(f"{k}={show(k, v)}" for k, v in s.items() if k not in ("method", "num_speculative_tokens"))
        name = f"{s['method']} k={s['num_speculative_tokens']}" + (f" {extra}" if extra else "")
    tags = [t for t in (cfg.backend if cfg.backend != "eager" else "", cfg.dtype if cfg.dtype != "fp32" else "",
                        cfg.quantize or "", f"tp{cfg.tensor_parallel_size}" if cfg.tensor_parallel_size > 1 else "",
                        Path(cfg.model).name if cfg.model else "")
            if t]
    return name + (f" [{' '.join(tags)}]" if tags else "")


def _from_artifacts(artifacts: str, spec: dict[str, Any] | None) -> dict[str, Any]:
    """Backend, dtype, proposer and quantization of an artifact directory (refusing a different proposer)."""
    import dataclasses

    from specair.compile.artifacts import read_manifest
    from specair.compile.plan import Plan
    from specair.compile.spec_config import SpeculativeConfig

    manifest = read_manifest(Path(artifacts))
    plan = Plan.from_json(manifest["plan"])
    compiled = plan.speculative
    if spec is not None and SpeculativeConfig.parse(spec) != compiled:
        raise InputError(f"{artifacts} was compiled for {compiled}, not {spec}; drop the speculative config to "
                         "use the compiled one")
    if compiled is not None and spec is None:  # the keys that differ from the defaults, for the name
        defaults = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}
        spec = {k: v for k, v in dataclasses.asdict(compiled).items()
                if k in ("method", "num_speculative_tokens") or v != defaults.get(k)}
    return {"speculative_config": spec, "backend": manifest["backend"], "dtype": plan.dtype,
            "quantize": (manifest.get("quantization") or {}).get("method")}


def parse_configs(entries: Sequence[Any], backends: Sequence[str] = ("eager",),
                  acceptances: Sequence[str] = (), dtype: str = "fp32",
                  tensor_parallel_size: int = 1) -> list[BenchConfig]:
    """Expand configuration entries into BenchConfigs, autoregressive baselines first.

    An entry is null (autoregressive), a speculative config ({"method": ...}), or an object with any of
    "speculative_config", "backend", "dtype", "quantize" (onnx: int4, int8), "artifacts", "name",
    "tensor_parallel_size" (default `tensor_parallel_size`; at most one configuration may use more than one rank:
    a process drives one torch.distributed group). Entries
    without a backend run on every one of `backends`; speculative ones without "acceptance" run with each of
    `acceptances` (when given). Every (backend, dtype, quantize) gets an autoregressive baseline unless an
    entry already is one (artifact directories excepted: they are compiled for one proposer).
    """
    from specair.runtime.proposers import parse_config, proposer_class

    out: list[BenchConfig] = []
    for entry in entries:
        if entry is None or isinstance(entry, dict) and "method" in entry:
            entry = {"speculative_config": entry}
        if not isinstance(entry, dict):
            raise InputError(f"a configuration must be null, a speculative config or an object, got {entry!r}")
        unknown = set(entry) - {"speculative_config", "backend", "dtype", "quantize", "artifacts", "name",
                                "tensor_parallel_size", "model"}
        if unknown:
            raise InputError(f"unknown configuration key(s) {sorted(unknown)}")
        spec = entry.get("speculative_config")
        if isinstance(spec, str) and spec != AUTO:  # "auto" is resolved by the engine, as for `specair generate`
            spec = json.loads(spec)
        if isinstance(spec, dict) and "num_speculative_tokens" not in spec:  # what the heads were trained for
            spec = {**proposer_class(spec.get("method")).config_defaults(spec.get("model")), **spec}
        if isinstance(spec, dict):
            parse_config(spec)  # refuse a bad config before loading anything
        if entry.get("artifacts"):
            if set(entry) & {"backend", "dtype", "quantize"}:
                raise InputError(f"{entry['artifacts']}: backend, dtype and quantize come from the artifacts' "
                                 "manifest")
            out.append(BenchConfig(**_from_artifacts(entry["artifacts"], spec), artifacts=entry["artifacts"],
                                   name=entry.get("name")))
            continue
        specs = ([{**spec, "acceptance": a} for a in acceptances]
                 if isinstance(spec, dict) and acceptances and "acceptance" not in spec else [spec])
        for be in [entry["backend"]] if "backend" in entry else backends:
            for sp in specs:
                name = entry.get("name")
                if name and len(specs) > 1:
                    name += f" ({sp['acceptance']})"
                out.append(BenchConfig(sp, be, entry.get("dtype", dtype), name=name, quantize=entry.get("quantize"),
                                       tensor_parallel_size=int(entry.get("tensor_parallel_size",
                                                                          tensor_parallel_size)),
                                       model=entry.get("model")))
    # Baselines: any autoregressive configuration; one is added per (backend, dtype) that lacks it (not for
    # artifacts: their speculative configurations fall back to the reference when no autoregressive artifact
    # with the same backend and quantization is listed).
    baselines = {c.baseline_key for c in out if c.speculative_config is None}
    needed = [BenchConfig(None, be, dt, quantize=q, tensor_parallel_size=tp, model=m) for be, dt, q, tp, m in
              dict.fromkeys(c.baseline_key for c in out if not c.artifacts) if (be, dt, q, tp, m) not in baselines]
    configs = out + needed
    if sum(c.tensor_parallel_size > 1 for c in configs) > 1:
        raise InputError("at most one configuration may use tensor_parallel_size > 1 (a process drives one "
                         "torch.distributed group; an autoregressive one is its own baseline)")
    # Baselines first, plain eager fp32 first among them (the reference), then the main job; the listed order
    # otherwise kept.
    configs.sort(key=lambda c: (c.speculative_config is not None, c.speculative_config != AUTO,
                                c.baseline_key != ("eager", "fp32", None, 1, None)))
    names = [c.label for c in configs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise InputError(f"two configurations share the name(s) {sorted(dup)}; give them distinct 'name's")
    return configs


def default_config_entries(model: str | None) -> list[Any]:
    """The main job (with its autoregressive baseline on the same backend), then autoregressive, prompt lookup
    and (for the default model) the trained heads shipped under models/heads/ when they are there."""
    from specair.runtime.proposers import PROPOSERS, shipped_head

    entries: list[Any] = [MAIN_JOB, None, *DEFAULT_SPECS]
    if model is None:
        for method, cls in PROPOSERS.items():
            try:
                if getattr(cls, "shipped", None):
                    shipped_head(cls.shipped)
                    entries.append({"method": method})
            except InputError:
                continue
    return entries


# ---------------------------------------------------------------- runners


class Runner(Protocol):
    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams, rnd: int,
            indices: Sequence[int]) -> tuple[list[Sample], float]: ...


class SpecairRunner:
    """A specair LLM for one configuration. Batch 1 is timed from its token stream, like every peer;
    larger batches are submitted together through LLM.generate."""

    def __init__(self, model: str | None, config: BenchConfig, max_context: int, batch_buckets: Sequence[int],
                 threads: int | None, device: str | None = None) -> None:
        from specair.runtime.llm import LLM

        spec = None if config.artifacts else config.speculative_config  # artifacts carry their own
        tp = config.tensor_parallel_size  # its ranks share the threads
        self.llm = LLM(model, spec, backend=config.backend, artifacts=config.artifacts,
                       dtype=config.dtype, max_context=None if config.artifacts else max_context,
                       batch_buckets=tuple(batch_buckets), threads=threads if threads is None else max(1, threads // tp),
                       max_waiting=max(64, *batch_buckets), quantize=None if config.artifacts else config.quantize,
                       device=device, tensor_parallel_size=tp)
        self.tokenizer = self.llm.tokenizer
        self.llm.engine.graphs.load_pending()

    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams, rnd: int,
            indices: Sequence[int]) -> tuple[list[Sample], float]:
        cache = self.llm.engine.prefix_cache
        if cache is not None:  # each measured prompt prefills whole, as the peers' do; the warm-up ran it before
            cache.clear()
        if len(prompts) > 1:
            t0 = time.perf_counter()
            results = self.llm.generate([list(p) for p in prompts], params)
            wall = time.perf_counter() - t0
            return [Sample(i, rnd, r.token_ids, r.ttft_s, float("nan"), spec=r.extra.get("spec"))
                    for i, r in zip(indices, results)], wall
        t0 = time.perf_counter()
        t_first = t_last = None
        passes, result = 0, None
        for ev in self.llm.stream(list(prompts[0]), params):
            if ev.token_ids:
                t_last = time.perf_counter()
                if t_first is None:
                    t_first = t_last
                else:
                    passes += 1  # every engine step after the prefill is one target pass
            if ev.result is not None:
                result = ev.result
        wall = time.perf_counter() - t0
        assert result is not None, "the stream ended without a result"
        t_first, t_last = t_first or wall + t0, t_last or wall + t0
        return [Sample(indices[0], rnd, result.token_ids, t_first - t0, t_last - t0, target_passes=passes,
                       spec=result.extra.get("spec"))], wall


def peer_label(peer: str, spec: dict[str, Any]) -> str:
    """An entry name for a peer."""
    n = spec.get("prompt_lookup_tokens")
    return {"hf": "transformers", "hf-prompt-lookup": f"transformers prompt lookup n={n}",
            "hf-assisted": f"transformers assisted ({Path(spec.get('assistant') or '').name})",
            "llama.cpp": "llama.cpp", "llama.cpp-prompt-lookup": f"llama.cpp prompt lookup n={n}",
            "openvino": "OpenVINO GenAI int4", "openvino-prompt-lookup": f"OpenVINO GenAI int4 prompt lookup n={n}"}[peer]


def make_runner(spec: dict[str, Any]) -> Runner:
    """Build a runner from its JSON description (also how the memory probe rebuilds it in a fresh process)."""
    if spec["kind"] == "specair":
        config = BenchConfig(**spec["config"])
        return SpecairRunner(config.model or spec["model"], config, spec["max_context"],
                             spec["batch_buckets"], spec["threads"], spec.get("device"))
    peer = spec["peer"]
    if peer in TRANSFORMERS_PEERS:
        if not spec.get("hf_dir"):
            raise PeerUnavailable("no HF checkpoint dir of the model for transformers (pass --hf-model)")
        return TransformersPeer(peer, spec["hf_dir"], assistant=spec.get("assistant"),
                                prompt_lookup_tokens=spec["prompt_lookup_tokens"],
                                prompt_lookup_max_ngram=spec["prompt_lookup_max_ngram"], threads=spec["threads"])
    if peer in OPENVINO_PEERS:
        if not spec.get("hf_dir"):
            raise PeerUnavailable("no HF checkpoint dir of the model to export for OpenVINO GenAI (pass --hf-model)")
        from specair.models.default_model import cache_dir

        return OpenVinoGenAIPeer(peer, spec["hf_dir"], cache_dir(), prompt_lookup_tokens=spec["prompt_lookup_tokens"],
                                 prompt_lookup_max_ngram=spec["prompt_lookup_max_ngram"], threads=spec["threads"])
    if not spec.get("gguf"):
        raise PeerUnavailable("no GGUF file of the model for llama.cpp (pass --gguf)")
    return LlamaCppPeer(peer, spec["gguf"], max_context=spec["max_context"],
                        prompt_lookup_tokens=spec["prompt_lookup_tokens"],
                        prompt_lookup_max_ngram=spec["prompt_lookup_max_ngram"], threads=spec["threads"],
                        seed=spec.get("seed"))


# ---------------------------------------------------------------- environment, bandwidth, memory


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Where the numbers come from: CPU, threads, memory, library versions, the commit."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        mem = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    commit = None
    try:
        commit = subprocess.run(["git", "-C", str(PACKAGE_ROOT), "describe", "--always", "--dirty"],
                                capture_output=True, text=True, timeout=10, check=False).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu": cpu, "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "memory_bytes": mem, "platform": platform.platform(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "git": commit,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": _version("transformers"), "onnxruntime": _version("onnxruntime"),
                     "llama_cpp_python": _version("llama_cpp_python"),
                     "openvino_genai": _version("openvino-genai"), "optimum_intel": _version("optimum-intel"), "numpy": _version("numpy"),
                     "specair": _version("specair")},
    }


def measure_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of several full reductions over a buffer larger than cache, held in
    transparent huge pages as specair's weights are (compile/backends/onnx_weights.HugePageArena): on 4 KiB
    pages the same reduction reads markedly slower here, and a floor below what the weights' reads reach would
    not be a floor."""
    import numpy as np
    import torch

    from specair.compile.backends.onnx_weights import HugePageArena

    x = torch.from_numpy(HugePageArena(chunk=nbytes).empty(nbytes).view(np.float32)).fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def weight_bytes_per_token(model: Any, quantization: Any = None) -> int:
    """Bytes of weights one decode step reads: every parameter, except an untied embedding table (a decode
    step reads one row of it; a tied one is the LM head and is read whole); with weight-only `quantization`
    (compile/quantize.Quantization), every linear layer's weight, the LM head included, as it stores them (a
    GGUF file's weights in their formats, as specair's kernels lay them out)."""
    import torch

    from specair.compile.kernels.formats import FORMATS
    from specair.models.llama import GGUF_PARTS

    skip = set() if model.output is None else {id(model.tok_embeddings.weight)}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    linear.add(id(model.tok_embeddings.weight if model.output is None else model.output.weight))
    seen: set[int] = set()
    total = 0.0
    for p in model.parameters():
        if id(p) in seen or id(p) in skip:
            continue
        seen.add(id(p))
        quantized = quantization is not None and id(p) in linear
        parts = getattr(p, GGUF_PARTS, None) if quantized and quantization.kernel != "MatMulNBits" else None
        if parts:
            total += sum(w.shape[0] * w.shape[1] * FORMATS.get(w.type, FORMATS["F32"]).bits_per_weight / 8
                         for w in parts)
        else:
            total += p.numel() * (quantization.bytes_per_weight(p.shape[-1]) if quantized else p.element_size())
    return int(total)


def gguf_bytes_per_token(path: str | os.PathLike) -> int:
    """The same for a GGUF file, in its own (quantized) encoding."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(path)).tensors
    names = {t.name for t in tensors}
    return sum(int(t.n_bytes) for t in tensors if not (t.name == "token_embd.weight" and "output.weight" in names))


def _peak_rss_bytes() -> int:
    """This process's peak RSS. On Linux VmHWM, which belongs to the address space that exec created;
    ru_maxrss would carry over the parent's RSS at fork, across exec."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def probe_peak_rss(runner_spec: dict[str, Any] | None, prompt: Sequence[int], params: SamplingParams,
                   threads: int | None) -> int | None:
    """Peak RSS of a fresh process that builds this runner alone and generates for the prompt (None for a
    bare process that only imports what the harness imports); None when the probe fails."""
    job = {"runner": runner_spec, "prompt": list(prompt), "params": asdict(params), "threads": threads}
    code = "from specair.benchmarks.run import _probe_main; _probe_main()"
    try:
        proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(job), capture_output=True, text=True,
                              timeout=1800, check=False)
        return int(json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_bytes"])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError):
        return None


def _probe_main() -> None:
    job = json.loads(sys.stdin.read())
    import torch

    import specair.runtime.llm  # noqa: F401  (the bare probe's imports match the harness's)

    if job["threads"]:
        torch.set_num_threads(job["threads"])
    if job["runner"] is not None:
        params = SamplingParams(**{**job["params"], "stop": tuple(job["params"]["stop"])})
        make_runner(job["runner"]).run([job["prompt"]], params, 0, [0])
    print(json.dumps({"peak_rss_bytes": _peak_rss_bytes()}))


# ---------------------------------------------------------------- profile


def profile_config(runner: SpecairRunner, prompt: Sequence[int], params: SamplingParams) -> dict[str, Any]:
    """Where one request's time goes: per graph kind (wall time of its calls), the host-side rest, and the
    top operators by self CPU time (torch.profiler) over the decode phase."""
    from torch.profiler import ProfilerActivity, profile

    graphs = runner.llm.engine.graphs
    graphs.timings = {}
    try:
        t0 = time.perf_counter()
        sample = runner.run([prompt], params, 0, [0])[0][0]
        wall = time.perf_counter() - t0
        timed = graphs.timings
    finally:
        graphs.timings = None
    steps = max(sample.target_passes or 0, 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.run([prompt], params, 0, [0])
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_self = sum(e.self_cpu_time_total for e in events) or 1
    matmul = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm",
                                                                     "aten::matmul", "aten::linear"))
    graph_s = sum(s for s, _ in timed.values())
    return {
        "request_s": wall, "ttft_s": sample.ttft_s, "generated_tokens": sample.num_tokens, "steps": steps,
        "ms_per_step": 1e3 * (sample.total_s - sample.ttft_s) / steps,
        # Per graph kind: how often it ran, what one call costs, and its share of a step (prefill: of the TTFT).
        "graphs": {k: {"calls": n, "ms_per_call": 1e3 * v / n,
                       "ms_per_step": None if k.endswith("prefill") else 1e3 * v / steps}
                   for k, (v, n) in timed.items()},
        "host_ms_per_step": 1e3 * max(wall - graph_s, 0.0) / steps,  # everything outside the graphs
        # torch.profiler over a second, identical request (prefill included): operators by self CPU time.
        "matmul_share_of_op_time": matmul / total_self,
        "ops_per_step": sum(e.count for e in events) / steps,
        "top_ops": [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls": e.count}
                    for e in events[:12]],
    }


# ---------------------------------------------------------------- the run


@dataclass
class BenchOptions:
    """Everything `specair bench` takes (the CLI's flags)."""

    model: str | None = None
    prompts: str = str(DEFAULT_PROMPTS)
    num_prompts: int | None = None
    config_entries: list[Any] | None = None  # None: default_config_entries(model)
    backends: tuple[str, ...] = ("eager",)
    acceptances: tuple[str, ...] = ()
    dtype: str = "fp32"
    tensor_parallel_size: int = 1
    max_tokens: int = 128
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    batch_sizes: tuple[int, ...] = (1,)
    rounds: int = 1
    warmup_tokens: int = 16
    peers: tuple[str, ...] | str = "auto"
    hf_model: str | None = None
    gguf: str | None = None
    ggufs: tuple[str, ...] = ()  # several GGUF files, each beside llama.cpp (--gguf is the first when both)
    assistant: str | None = None
    prompt_lookup_tokens: int = 10
    prompt_lookup_max_ngram: int = 3
    threads: int | None = None
    device: str | None = None  # None: each backend's own device
    max_context: int = 1024
    out: str = "bench-out/bench"
    memory: bool = True
    plots: bool = True
    profile: bool = False
    progress: bool = True
    command: str = ""
    notes: list[str] = field(default_factory=list)


def _resolve_peer_weights(opts: BenchOptions) -> tuple[str | None, str | None, list[str]]:
    """The HF dir and GGUF file holding the benchmarked model's weights, for the peers."""
    notes = []
    hf_dir, gguf = opts.hf_model, opts.gguf
    if opts.model is None:
        from specair.models.default_model import default_gguf_path, default_model_dir

        hf_dir = hf_dir or str(default_model_dir())
        gguf = gguf or str(default_gguf_path())
    else:
        if hf_dir is None and (Path(opts.model) / "config.json").is_file():
            hf_dir = opts.model
        if gguf is None and opts.model.endswith(".gguf"):
            gguf = opts.model
    if gguf:
        notes.append(f"llama.cpp runs {Path(gguf).name} with its own kernels, specair's int4 path reads the same "
                     "blocks with its own (int8 activations per block of 32 against llama.cpp's per-format choice), "
                     "and transformers the weights dequantized to float: the same weights, different arithmetic, so "
                     "outputs may differ.")
    return hf_dir, gguf, notes


def _peer_list(opts: BenchOptions) -> list[str]:
    if opts.peers == "auto":
        return [p for p in PEERS if p != "hf-assisted" or opts.assistant]
    if opts.peers in ("none", ()):
        return []
    peers = list(opts.peers)
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise InputError(f"unknown peer(s) {bad}; known: {', '.join(PEERS)}")
    for p in list(peers):  # a peer's speedup needs its engine's plain decoding beside it
        if peer_baseline(p) not in peers:
            peers.insert(0, peer_baseline(p))
    return list(dict.fromkeys(peers))


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Run the benchmark and write results.json, results.md and the plots into opts.out; return the report."""
    import torch
    from tqdm import tqdm

    if opts.threads:
        torch.set_num_threads(opts.threads)
    # Every engine gets the same thread count, explicitly (llama-cpp-python's default is half the cores).
    threads = opts.threads or torch.get_num_threads()
    params = SamplingParams(max_tokens=opts.max_tokens, temperature=opts.temperature, top_p=opts.top_p,
                            top_k=opts.top_k, seed=opts.seed, ignore_eos=opts.ignore_eos)
    greedy = opts.temperature == 0
    if any(b < 1 for b in opts.batch_sizes) or opts.rounds < 1:
        raise InputError("batch sizes and --rounds must be positive")
    records = load_prompt_set(opts.prompts)[:opts.num_prompts]
    configs = parse_configs(opts.config_entries if opts.config_entries is not None
                            else default_config_entries(opts.model), opts.backends, opts.acceptances, opts.dtype,
                            opts.tensor_parallel_size)
    peers = _peer_list(opts)
    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    notes = list(opts.notes)
    env = environment()
    buckets = sorted(set(opts.batch_sizes) | {1})

    # Build every runner first, so loading never lands between two measurements.
    entries: list[Entry] = []
    runners: dict[str, Runner] = {}
    baseline_of = {}
    for c in configs:
        if c.speculative_config is None:
            baseline_of.setdefault(c.baseline_key, c.label)
    for c in configs:
        spec = {"kind": "specair", "model": opts.model, "config": asdict(c), "max_context": opts.max_context,
                "batch_buckets": buckets, "threads": threads, "device": opts.device}
        _log(f"bench: building {c.label}")
        runners[c.label] = make_runner(spec)
        base = c.label if c.speculative_config is None else baseline_of.get(c.baseline_key)
        if base is None:
            base = baseline_of.get(("eager", c.dtype, None, 1, c.model), configs[0].label)
            notes.append(f"{c.label}: no autoregressive configuration with the same backend and quantization "
                         f"was listed; its speedup is over {base}")
        entries.append(Entry(c.label, "specair", base, spec))
    reference = entries[0].name
    ref_runner = runners[reference]
    assert isinstance(ref_runner, SpecairRunner)
    if peers:
        hf_dir, gguf, peer_notes = _resolve_peer_weights(opts)
        ggufs = list(dict.fromkeys(([gguf] if gguf else []) + list(opts.ggufs)))
        peer_entries: dict[str, Entry] = {}
        runs = [(p, g) for p in peers for g in (ggufs or [None] if peer_engine(p) == "llama.cpp" else [gguf])]
        for p, g in runs:
            spec = {"kind": "peer", "peer": p, "hf_dir": hf_dir, "gguf": g, "assistant": opts.assistant,
                    "max_context": opts.max_context, "prompt_lookup_tokens": opts.prompt_lookup_tokens,
                    "prompt_lookup_max_ngram": opts.prompt_lookup_max_ngram, "threads": threads,
                    "seed": opts.seed}
            tag = f" ({Path(g).name})" if len(ggufs) > 1 and peer_engine(p) == "llama.cpp" else ""
            name = peer_label(p, spec) + tag
            base = peer_label(peer_baseline(p), spec) + tag
            if base != name and base not in peer_entries:
                notes.append(f"{name} skipped: its baseline {base} did not run")
                continue
            try:
                _log(f"bench: building peer {name}")
                runners[name] = make_runner(spec)
            except PeerUnavailable as e:
                notes.append(f"peer {name} skipped: {e}")
                continue
            peer_entries[name] = Entry(name, peer_engine(p), base, spec)
        entries += peer_entries.values()
        if any(e.engine == "llama.cpp" for e in entries):
            notes += [n for n in peer_notes if "llama.cpp" in n]

    prompts = [encode_prompt(r, ref_runner.tokenizer) for r in records]
    too_long = [r["id"] for r, p in zip(records, prompts) if len(p) + 1 >= opts.max_context]
    if too_long:
        raise InputError(f"prompts {too_long} do not fit --max-context {opts.max_context}")

    # Warm-up: every runner once (the longest prompt, so graphs for its context exist before timing).
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    lazy_compiled = any(c.backend not in ("eager", "auto") and not c.artifacts for c in configs)  # auto: cached AOT
    warm = SamplingParams(max_tokens=opts.max_tokens if lazy_compiled else opts.warmup_tokens,
                          temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k, seed=opts.seed,
                          ignore_eos=True)
    if lazy_compiled:
        notes.append("compiled backends without --artifacts compile each graph on first use; the warm-up ran a "
                     "full-length request so no compile lands inside a measurement (use `specair compile` and "
                     "an 'artifacts' entry to skip that)")
    # Batch sweep (when asked for more than batch 1): groups of max(sizes) prompts; on each group every
    # configuration runs every batch size back to back (the group cut into batches of b submitted at once),
    # so the sizes are compared on the same prompts at the same time.
    sweep = sorted(set(opts.batch_sizes)) if any(b > 1 for b in opts.batch_sizes) else []
    batch_runners = [e for e in entries if e.engine == "specair" or e.runner.get("peer") == "hf"]
    width = max(sweep, default=1)
    groups = [list(range(i, i + width)) for i in range(0, len(prompts) - width + 1, width)] or \
        [[j % len(prompts) for j in range(width)]]
    total = opts.rounds * len(prompts) * len(entries) + len(groups) * len(batch_runners) * sum(
        -(-width // b) for b in sweep)
    bar = tqdm(total=total + len(entries), desc="bench", unit="run", file=sys.stderr, disable=not opts.progress)
    bw_start = measure_bandwidth()
    for e in entries:
        bar.set_postfix_str(f"warm-up {e.name}"[:60])
        runners[e.name].run([prompts[longest]], warm, 0, [longest])
        bar.update(1)

    # Batch 1: every configuration on each prompt before the next prompt; the order rotates per prompt so
    # no configuration always runs first (or right after a given other one).
    bw_during = []
    for rnd in range(opts.rounds):
        for i, ids in enumerate(prompts):
            bw_during.append(measure_bandwidth(repeats=3))  # what the machine gives while the prompts run
            shift = (rnd * len(prompts) + i) % len(entries)
            for e in entries[shift:] + entries[:shift]:
                bar.set_postfix_str(f"{records[i]['id']} {e.name}"[:60])
                e.samples += runners[e.name].run([ids], params, rnd, [i])[0]
                bar.update(1)

    for e in batch_runners:
        engine = getattr(getattr(runners[e.name], "llm", None), "engine", None)
        if engine is not None and engine.num_slots < width:
            notes.append(f"{e.name} has {engine.num_slots} sequence slot(s) (its compiled batch buckets): larger "
                         "batches queue behind them")
    for n, g in enumerate(groups):
        shift = n % len(batch_runners)
        for e in batch_runners[shift:] + batch_runners[:shift]:
            for b in sweep:
                for chunk in (g[k:k + b] for k in range(0, len(g), b)):
                    bar.set_postfix_str(f"batch {b} {e.name}"[:60])
                    samples, wall = runners[e.name].run([prompts[j] for j in chunk], params, 0, chunk)
                    e.batches.append(BatchRun(b, chunk, wall, sum(s.num_tokens for s in samples)))
                    bar.update(1)
    bar.close()

    # The bandwidth floor for the reference model, and for the GGUF llama.cpp reads.
    bw_end = measure_bandwidth()
    # The machine's bandwidth moves with its neighbours' load (here by up to 2x within minutes), so it is
    # sampled before every prompt, as the configurations run, and the median taken.
    samples = sorted([bw_start, *bw_during, bw_end])
    bw = samples[len(samples) // 2]
    floor: dict[str, Any] = {"read_bandwidth_GB_s": bw / 1e9,
                             "method": "torch.sum over a 512 MiB fp32 buffer in huge pages with the benchmark's torch threads (best of 5 before and after the runs, best of 3 before "
                             "each prompt); the median of those readings",
                             "read_bandwidth_GB_s_start_end": [bw_start / 1e9, bw_end / 1e9],
                             "read_bandwidth_GB_s_samples": [round(b / 1e9, 2) for b in samples]}
    engine = ref_runner.llm.engine
    floor["weight_bytes_per_token"] = weight_bytes_per_token(engine.target,
                                                             getattr(engine.graphs.backend, "quantization", None))
    floor["floor_tokens_per_s"] = bw / floor["weight_bytes_per_token"]
    floor["floor_ms_per_token"] = 1e3 / floor["floor_tokens_per_s"]
    llama_entry = next((e for e in entries if e.engine == "llama.cpp"), None)
    if llama_entry is not None:
        gb = gguf_bytes_per_token(llama_entry.runner["gguf"])
        floor["gguf_bytes_per_token"] = gb
        floor["gguf_floor_tokens_per_s"] = bw / gb
    # every configuration's own floor: the weights it reads per token, as it stores them
    per_entry = {}
    for e in entries:
        if e.engine == "specair":
            eng = runners[e.name].llm.engine
            per_entry[e.name] = weight_bytes_per_token(eng.target, getattr(eng.graphs.backend, "quantization", None))
        elif e.engine == "llama.cpp":
            per_entry[e.name] = gguf_bytes_per_token(e.runner["gguf"])
    floor["bytes_per_token"] = per_entry
    floor["floor_ms_per_token_of"] = {n: 1e3 * b / bw for n, b in per_entry.items()}

    # Peak memory: each configuration alone in a fresh process (measurements above are not disturbed).
    memory_method = "not measured (--no-memory)"
    if opts.memory:
        memory_method = ("peak resident set size (VmHWM on Linux) of a fresh process that loads that "
                         "configuration alone and generates 16 tokens for the longest prompt")
        bare = probe_peak_rss(None, prompts[longest], params, threads)
        if bare:
            notes.append(f"a bare process that only imports torch and specair's runtime peaks at "
                         f"{bare / 2**20:.0f} MB RSS; every configuration's peak RSS includes that")
        probe_params = SamplingParams(max_tokens=min(opts.max_tokens, 16), temperature=opts.temperature,
                                      ignore_eos=True)
        for e in tqdm(entries, desc="memory", file=sys.stderr, disable=not opts.progress):
            e.peak_rss_bytes = probe_peak_rss(e.runner, prompts[longest], probe_params, threads)

    summary = summarize(entries, reference, greedy)
    ref_decode = summary[reference]["decode_tokens_per_s"]
    floor["reference_decode_tokens_per_s"] = ref_decode
    floor["floor_over_reference"] = floor["floor_tokens_per_s"] / ref_decode if ref_decode else None

    profiles = {}
    if opts.profile:
        best = max((n for n, m in summary.items() if m["engine"] == "specair" and n != reference),
                   key=lambda n: summary[n]["speedup"] or 0, default=None)
        for name in [reference] + ([best] if best else []):
            _log(f"bench: profiling {name}")
            profiles[name] = profile_config(runners[name], prompts[0], params)

    report: dict[str, Any] = {
        "command": opts.command or "specair bench", "model": opts.model or "SmolLM2-135M-Instruct (default)",
        "prompts_file": str(opts.prompts), "num_prompts": len(prompts),
        "prompt_ids": [r["id"] for r in records], "prompt_tokens": [len(p) for p in prompts],
        "rounds": opts.rounds, "max_tokens": opts.max_tokens, "ignore_eos": opts.ignore_eos, "greedy": greedy,
        "sampling": {"temperature": opts.temperature, "top_p": opts.top_p, "top_k": opts.top_k, "seed": opts.seed},
        "batch_sizes": list(opts.batch_sizes), "reference": reference, "environment": env,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "bandwidth_floor": floor, "memory_method": memory_method, "summary": summary, "profiles": profiles,
        "notes": notes,
    }
    if opts.plots:
        report["plots"] = [str(p) for p in plot_all(summary, out_dir)]
    write_json(out_dir / "results.json", report, entries)
    (out_dir / "results.md").write_text(markdown_report(report))
    return report


# ---------------------------------------------------------------- command line


def _csv(kind: type) -> Any:
    def parse(text: str) -> tuple[Any, ...]:
        try:
            return tuple(kind(x.strip()) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
    return parse


def add_bench_parser(subparsers: Any) -> None:
    """Add `specair bench` to the CLI's subparsers."""
    p = subparsers.add_parser(
        "bench", help="measure autoregressive and speculative configurations (and peers) side by side",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF checkpoint dir, GGUF file or llama2.c .bin (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), metavar="FILE.jsonl",
                   help='one {"messages": [...]} or {"prompt": ...} per line (default: the shipped prompt set)')
    p.add_argument("--num-prompts", type=int, help="use only the first N prompts (the shipped set cycles through "
                   "its six categories, so multiples of 6 keep them balanced)")
    p.add_argument("--configs", metavar="FILE.json", help="a JSON list of configurations: null (autoregressive), a "
                   'speculative config, or {"speculative_config", "backend", "dtype", "quantize", "artifacts", "name"}')
    p.add_argument("--spec", action="append", default=[], metavar="JSON",
                   help="a speculative config to measure (repeatable; with --configs, added to its list)")
    p.add_argument("--backends", type=_csv(str), default=("eager",),
                   help="backends for configurations that name none (default eager)")
    p.add_argument("--acceptance", type=_csv(str), default=(),
                   help="acceptance methods to cross with every speculative config without one, e.g. exact,typical")
    p.add_argument("--dtype", default="fp32", help="dtype for configurations that name none")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="ranks for configurations that name none (sharing --threads)")
    p.add_argument("--device", help="where specair's models and graph inputs live (default: each backend's device)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="generate max-tokens tokens for every prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--batch-sizes", type=_csv(int), default=(1,), help="e.g. 1,2,4: also submit groups of N prompts "
                   "at once and report tokens/s per batch size")
    p.add_argument("--rounds", type=int, default=1, help="passes over the prompt set")
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--peers", default="auto", help="auto (every installed peer), none, or a list of "
                   + ",".join(PEERS))
    p.add_argument("--hf-model", help="HF dir of the same weights for the transformers peers")
    p.add_argument("--gguf", help="GGUF file of the same weights for the llama.cpp peers")
    p.add_argument("--assistant", metavar="HF_DIR", help="assistant (draft) model for transformers' assisted "
                   "generation")
    p.add_argument("--prompt-lookup-tokens", type=int, default=10, help="peers' prompt-lookup draft length")
    p.add_argument("--prompt-lookup-max-ngram", type=int, default=3, help="peers' prompt-lookup longest n-gram")
    p.add_argument("--threads", type=int, help="CPU threads for every engine")
    p.add_argument("--max-context", type=int, default=1024, help="tokens of context per sequence (default 1024)")
    p.add_argument("--out", default="bench-out/bench", metavar="DIR")
    p.add_argument("--no-memory", action="store_true", help="skip the per-configuration peak-memory probes")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="also break down where a step's time goes for autoregressive and the best configuration")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--ladder", action="store_true", help="plain decoding at four model sizes (SmolLM2-135M, and "
                   "random-weight checkpoints of SmolLM2-360M's, SmolLM2-1.7B's and Qwen3-1.7B's shapes, for speed "
                   "only): specair's defaults and a Q4_K_M file beside llama.cpp (the same GGUF files) and OpenVINO "
                   "GenAI int4, one bench run per rung (see benchmarks/ladder.py)")
    p.add_argument("--rungs", type=_csv(str), help="with --ladder: only these rungs (smollm2-135m, smollm2-360m, "
                   "smollm2-1.7b, qwen3-1.7b)")
    p.set_defaults(func=cmd_bench)


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """BenchOptions from parsed `specair bench` arguments."""
    entries: list[Any] | None = None
    if args.configs:
        try:
            entries = json.loads(Path(args.configs).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"--configs {args.configs}: {e}") from None
        if not isinstance(entries, list):
            raise InputError(f"--configs {args.configs} must hold a JSON list")
    if args.spec:
        try:
            specs = [json.loads(s) for s in args.spec]
        except json.JSONDecodeError as e:
            raise InputError(f"--spec is not valid JSON: {e}") from None
        entries = (entries if entries is not None else [None]) + specs
    peers = args.peers if args.peers in ("auto", "none") else _csv(str)(args.peers)
    return BenchOptions(
        model=args.model, prompts=args.prompts, num_prompts=args.num_prompts, config_entries=entries,
        backends=args.backends, acceptances=args.acceptance, dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size, max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, batch_sizes=args.batch_sizes, rounds=args.rounds, warmup_tokens=args.warmup_tokens,
        peers=peers, hf_model=args.hf_model, gguf=args.gguf, assistant=args.assistant,
        prompt_lookup_tokens=args.prompt_lookup_tokens, prompt_lookup_max_ngram=args.prompt_lookup_max_ngram,
        threads=args.threads, device=args.device, max_context=args.max_context, out=args.out, memory=not args.no_memory,
        plots=not args.no_plots, profile=args.profile, progress=not args.no_progress,
        command=shlex.join(["specair", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else "specair bench")


def cmd_bench(args: argparse.Namespace) -> None:
    """`specair bench`: run, write the files, print the table."""
    if args.ladder:
        from specair.benchmarks.ladder import run_ladder

        if args.configs or args.spec or args.model:
            raise InputError("--ladder picks its own models and configurations; drop --model, --configs and --spec")
        ladder = run_ladder(options_from_args(args), list(args.rungs) if args.rungs else None)
        print((Path(args.out) / "ladder.md").read_text())
        print(f"wrote {Path(args.out) / 'ladder.json'}" + "".join(f", {p}" for p in ladder.get("plots", [])))
        return
    report = run_bench(options_from_args(args))
    print(markdown_table(report["summary"]))
    for n in report["notes"]:
        print(f"note: {n}")
    print(f"wrote {Path(args.out) / 'results.json'}, {Path(args.out) / 'results.md'}"
          + "".join(f", {p}" for p in report.get("plots", [])))
