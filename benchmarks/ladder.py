"""`specair bench --ladder`: plain decoding at four model sizes, each rung one interleaved `specair bench` run:
specair on its defaults (`--model` only) and on a Q4_K_M file, beside llama.cpp on the same GGUF files (Q4_1,
the type specair's default int4 holds, and Q4_K_M) and OpenVINO GenAI int4.

Rungs: SmolLM2-135M-Instruct (its real weights: the default model's Q4_1 file, and a Q4_K_M made from its
float conversion), then random-weight checkpoints of SmolLM2-360M's, SmolLM2-1.7B's and Qwen3-1.7B's real
shapes, written here in bf16 as HF directories (their tokenizer is SmolLM2's; the vocabulary is padded to the
shape's), turned into GGUF files by llama.cpp's own converter (convert_hf_to_gguf.py, from the
llama-cpp-python sdist of the installed version) and quantizer (`llama_model_quantize`). Random weights
measure speed only: every table and plot says so, and no acceptance or quality is read from them.

Everything is cached under $SPECAIR_CACHE/ladder/<rung>/; the results go to --out: one folder per rung (the
bench's own results.md/json) and ladder.md, ladder.json, ladder-tokens-per-s.png, ladder-decode-vs-floor.png.
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specair.models.errors import InputError, SpecairError


class LadderError(SpecairError):
    """A rung's files could not be made (llama.cpp's converter or quantizer missing or failing)."""


@dataclass(frozen=True)
class Rung:
    name: str
    label: str
    real: bool
    arch: str = "llama"  # transformers config class: llama or qwen3
    config: dict[str, Any] | None = None  # the HF config of a random-weight rung


_SMOLLM2 = dict(vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                bos_token_id=1, eos_token_id=2, hidden_act="silu")
RUNGS = (
    Rung("smollm2-135m", "SmolLM2-135M-Instruct", real=True),
    Rung("smollm2-360m", "SmolLM2-360M shapes", real=False, config=dict(
        _SMOLLM2, hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
        num_key_value_heads=5, rope_theta=100000.0)),
    Rung("smollm2-1.7b", "SmolLM2-1.7B shapes", real=False, config=dict(
        _SMOLLM2, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=32, rope_theta=130000.0)),
    Rung("qwen3-1.7b", "Qwen3-1.7B shapes", real=False, arch="qwen3", config=dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, hidden_act="silu")),
)
SPEED_ONLY = "random weights, speed only"


def rung_title(r: Rung) -> str:
    return r.label if r.real else f"{r.label} ({SPEED_ONLY})"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ files


def write_random_checkpoint(rung: Rung, out: Path, seed: int = 0) -> Path:
    """An HF directory of the rung's shapes with random bf16 weights (N(0, 0.02), norms near 1) and SmolLM2's
    tokenizer, written atomically."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from tqdm import tqdm

    from specair.models.checkpoint import expected_shapes
    from specair.models.config import ModelConfig
    from specair.models.default_model import default_model_dir

    if (out / "config.json").is_file():
        return out
    cls = transformers.Qwen3Config if rung.arch == "qwen3" else transformers.LlamaConfig
    arch = "Qwen3ForCausalLM" if rung.arch == "qwen3" else "LlamaForCausalLM"
    hf = cls(**rung.config, architectures=[arch], torch_dtype="bfloat16").to_dict()
    cfg = ModelConfig.from_hf(hf)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in tqdm(expected_shapes(cfg).items(), desc=f"writing {rung.label} ({SPEED_ONLY})",
                            unit="tensor", file=sys.stderr, leave=False):
        base = 1.0 if name.endswith("norm.weight") else 0.0
        weights[name] = (base + 0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    del weights
    (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    src = default_model_dir(progress=False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, tmp / f)
    (tmp / "README.md").write_text(f"Random weights of {rung.label}: for speed measurements only.\n")
    tmp.rename(out)
    return out


def converter(cache: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py with its conversion/ and gguf-py/ folders, from the sdist of the
    installed llama-cpp-python (`pip download --no-deps --no-binary :all:`), cached."""
    try:
        from importlib.metadata import version

        v = version("llama_cpp_python")
    except Exception:  # noqa: BLE001 - not installed
        raise LadderError("the ladder makes its GGUF files with llama.cpp's converter and quantizer: install "
                          "llama-cpp-python (pip install llama-cpp-python==0.3.36, ~7 min of compiling)") from None
    root = cache / f"llama.cpp-converter-{v}"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    with tempfile.TemporaryDirectory(prefix="specair-sdist-") as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={v}", "-d", tmp], capture_output=True, text=True)
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if r.returncode or not sdists:
            raise LadderError(f"could not fetch the llama-cpp-python {v} sdist for its converter: {r.stderr[-500:]}")
        staging = Path(tmp) / "out"
        with tarfile.open(sdists[0]) as tar:
            for m in tar.getmembers():
                parts = Path(m.name).parts
                if len(parts) > 3 and parts[1:3] == ("vendor", "llama.cpp") and (
                        parts[3] in ("convert_hf_to_gguf.py", "conversion", "gguf-py")):
                    m.name = str(Path(*parts[3:]))
                    tar.extract(m, staging, filter="data")
        root.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)
        shutil.move(str(staging), root)
    return root


def convert(hf_dir: Path, out: Path, cache: Path, outtype: str = "f16") -> Path:
    """An HF directory as a GGUF file of `outtype`, by llama.cpp's own converter."""
    if out.is_file():
        return out
    root = converter(cache)
    tmp = out.with_name(out.name + ".tmp")
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", outtype,
                        "--outfile", str(tmp)], env=env, capture_output=True, text=True)
    if r.returncode:
        tmp.unlink(missing_ok=True)
        raise LadderError(f"llama.cpp's converter failed on {hf_dir}: {r.stderr[-1500:]}")
    tmp.rename(out)
    return out


def quantize(src: Path, out: Path, kind: str, threads: int) -> Path:
    """`src` (a float GGUF) quantized to `kind` (Q4_1, Q4_K_M, ...) by llama.cpp's own quantizer."""
    if out.is_file():
        return out
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = threads
    tmp = out.with_name(out.name + ".tmp")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)):
        tmp.unlink(missing_ok=True)
        raise LadderError(f"llama.cpp's quantizer failed to make {kind} from {src}")
    tmp.rename(out)
    return out


@dataclass(frozen=True)
class RungFiles:
    hf_dir: Path  # what specair's defaults and OpenVINO read
    model: str | None  # what `--model` is on the defaults (None: the default model)
    q4_1: Path
    q4_k_m: Path


def prepare(rung: Rung, cache: Path, threads: int) -> RungFiles:
    """The rung's HF directory and GGUF files, made once and cached."""
    from specair.models.default_model import default_gguf_path, default_model_dir

    d = cache / "ladder" / rung.name
    d.mkdir(parents=True, exist_ok=True)
    if rung.real:
        hf, model, q4_1 = default_model_dir(progress=False), None, default_gguf_path()
    else:
        hf = write_random_checkpoint(rung, d / "hf")
        model = str(hf)
        q4_1 = d / "model-Q4_1.gguf" if (d / "model-Q4_1.gguf").is_file() else None
    if q4_1 is None or not (d / "model-Q4_K_M.gguf").is_file():
        _log(f"ladder: making {rung.label}'s GGUF files with llama.cpp's converter and quantizer")
        float_gguf = convert(hf, d / "model-float.gguf", cache, "f32" if rung.real else "bf16")
        q4_1 = q4_1 or quantize(float_gguf, d / "model-Q4_1.gguf", "Q4_1", threads)
        quantize(float_gguf, d / "model-Q4_K_M.gguf", "Q4_K_M", threads)
        float_gguf.unlink()  # only the quantized files are measured
    return RungFiles(hf, model, Path(q4_1), d / "model-Q4_K_M.gguf")


# ------------------------------------------------------------------------------------------------- runs

DEFAULTS, Q4KM = "specair defaults", "specair Q4_K_M"


def run_ladder(opts: Any, rung_names: list[str] | None = None) -> dict[str, Any]:
    """Every rung's bench (opts: the BenchOptions of `specair bench`, whose --out is the ladder's folder)."""
    from specair.benchmarks.run import run_bench
    from specair.models.default_model import cache_dir

    rungs = [r for r in RUNGS if rung_names is None or r.name in rung_names]
    if rung_names and len(rungs) != len(rung_names):
        raise InputError(f"unknown rung(s) {sorted(set(rung_names) - {r.name for r in RUNGS})}; the ladder has "
                         f"{', '.join(r.name for r in RUNGS)}")
    threads = opts.threads or 2
    out = Path(opts.out)
    rows, environment = [], None
    for rung in rungs:
        files = prepare(rung, cache_dir(), threads)
        configs = [{"speculative_config": None, "backend": "auto", "name": DEFAULTS},
                   {"speculative_config": None, "backend": "auto", "model": str(files.q4_k_m), "name": Q4KM}]
        peers = ("llama.cpp", "openvino") if opts.peers == "auto" else opts.peers
        sub = replace(opts, model=files.model, config_entries=configs, peers=peers, hf_model=str(files.hf_dir),
                      gguf=str(files.q4_1), ggufs=(str(files.q4_k_m),), out=str(out / rung.name), memory=False,
                      notes=[] if rung.real else [f"{rung.label}: {SPEED_ONLY}"], command=opts.command)
        _log(f"ladder: {rung_title(rung)}")
        report = run_bench(sub)
        rows.append(rung_row(rung, files, report))
        environment = report["environment"]
        del report
        gc.collect()  # this rung's engines and peers go before the next rung's load
    ladder = {"command": opts.command, "rungs": rows, "threads": threads,
              "environment": environment if rows else None}
    out.mkdir(parents=True, exist_ok=True)
    (out / "ladder.json").write_text(json.dumps(ladder, indent=2) + "\n")
    (out / "ladder.md").write_text(ladder_markdown(ladder))
    if opts.plots:
        ladder["plots"] = [str(p) for p in plot_ladder(ladder, out)]
    return ladder


def rung_row(rung: Rung, files: RungFiles, report: dict[str, Any]) -> dict[str, Any]:
    """One rung's figures: decode tok/s and ms per token of every entry, its floor, and the ratios."""
    summary, floor = report["summary"], report["bandwidth_floor"]
    # llama.cpp's rows by the file's type, so that rungs line up (the 135M rung's Q4_1 file has its own name)
    by_type = {f"({files.q4_1.name})": "(Q4_1)", f"({files.q4_k_m.name})": "(Q4_K_M)"}
    entries = {}
    for name, m in summary.items():
        label = name
        for old, new in by_type.items():
            label = label.replace(old, new) if m["engine"] == "llama.cpp" else label
        entries[label] = {"engine": m["engine"], "decode_tokens_per_s": m["decode_tokens_per_s"],
                         "tokens_per_s": m["tokens_per_s"], "tpot_ms": m.get("tpot_ms"),
                         "floor_ms_per_token": floor.get("floor_ms_per_token_of", {}).get(name),
                         "bytes_per_token": floor.get("bytes_per_token", {}).get(name), "bench_name": name}
    peers = {n: e["decode_tokens_per_s"] for n, e in entries.items() if e["engine"] != "specair"}
    best_peer = max(peers, key=lambda n: peers[n] or 0, default=None)
    row: dict[str, Any] = {"rung": rung.name, "label": rung_title(rung), "real_weights": rung.real,
                           "bandwidth_GB_s": floor["read_bandwidth_GB_s"], "entries": entries,
                           "best_peer": best_peer, "files": {k: str(v) for k, v in vars(files).items() if v}}
    for name in (DEFAULTS, Q4KM):
        e = entries.get(name)
        if e and best_peer and peers[best_peer]:
            e["over_best_peer"] = e["decode_tokens_per_s"] / peers[best_peer]
        if e and e.get("floor_ms_per_token") and e.get("tpot_ms"):
            e["over_floor"] = e["tpot_ms"] / e["floor_ms_per_token"]
    return row


def ladder_markdown(ladder: dict[str, Any]) -> str:
    lines = ["# Size ladder: plain decoding, batch 1, greedy", "",
             f"`{ladder['command']}` ({ladder['threads']} threads). Decode tok/s (prefill excluded); "
             "× best peer is against the fastest peer on that rung; × floor is the decode step's time over the "
             "time to read that configuration's weights once at the measured bandwidth. Rungs marked "
             f"'{SPEED_ONLY}' have random weights: they measure speed only.", ""]
    for row in ladder["rungs"]:
        lines += [f"## {row['label']}", "", f"Read bandwidth {row['bandwidth_GB_s']:.1f} GB/s.", "",
                  "| configuration | decode tok/s | ms/token | weights MB/token | floor ms | × floor | × best peer |",
                  "|---|---|---|---|---|---|---|"]
        for name, e in row["entries"].items():
            f = lambda v, fmt: "–" if v is None else format(v, fmt)  # noqa: E731
            lines.append(f"| {name} | {f(e['decode_tokens_per_s'], '.1f')} | {f(e['tpot_ms'], '.1f')} | "
                         f"{f(e['bytes_per_token'] and e['bytes_per_token'] / 1e6, '.0f')} | "
                         f"{f(e['floor_ms_per_token'], '.1f')} | {f(e.get('over_floor'), '.2f')} | "
                         f"{f(e.get('over_best_peer'), '.2f')} |")
        lines.append("")
    return "\n".join(lines)


def plot_ladder(ladder: dict[str, Any], out: Path) -> list[Path]:
    """Decode tok/s of every configuration per rung, and specair's decode step against its floor per rung."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ladder["rungs"]
    labels = [r["label"].replace(" (", "\n(") for r in rows]
    names = list(dict.fromkeys(n for r in rows for n in r["entries"]))
    width = 0.8 / max(1, len(names))

    def bars(ax: Any) -> None:
        for i, n in enumerate(names):
            vals = [r["entries"].get(n, {}).get("decode_tokens_per_s") or 0 for r in rows]
            ax.bar([x + i * width for x in range(len(rows))], vals, width, label=n)
        ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(rows))], labels, fontsize=8)

    def floors(ax: Any) -> None:
        for n, marker in ((DEFAULTS, "o"), (Q4KM, "s")):
            for key, style, what in (("tpot_ms", "-", "decode step"), ("floor_ms_per_token", "--", "bandwidth floor")):
                vals = [r["entries"].get(n, {}).get(key) or math.nan for r in rows]
                ax.plot(range(len(rows)), vals, marker=marker, linestyle=style, label=f"{n}: {what}")
        ax.set_xticks(range(len(rows)), labels, fontsize=8)

    paths = []
    for name, draw, ylabel, title in (
            ("ladder-tokens-per-s.png", bars, "decode tokens/s (batch 1, greedy)", "Plain decoding by model size"),
            ("ladder-decode-vs-floor.png", floors, "ms per token",
             "specair's decode step against the time to read its weights once")):
        fig, ax = plt.subplots(figsize=(max(7, 2.4 * len(rows)), 4.5))
        draw(ax)
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
