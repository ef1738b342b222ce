"""`specair bench`'s arithmetic and outputs: per-request measurements in, per-configuration metrics,
JSON, a Markdown table and PNG plots out.

Metrics follow Spec-Bench: speedup is computed per prompt (tokens/s of the configuration over tokens/s
of its baseline on the same prompt and round) and then averaged; tau is tokens per target pass.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Any


@dataclass
class Sample:
    """One request's measurement (times from submitting the request, in seconds)."""

    prompt: int  # index into the prompt set
    round: int
    token_ids: list[int]
    ttft_s: float  # submit -> first generated token
    total_s: float  # submit -> last generated token
    target_passes: int | None = None  # target forward passes after the first token, where the engine shows them
    spec: dict[str, Any] | None = None  # GenerationResult.extra["spec"] of a speculative configuration

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        """End to end: generated tokens over the whole request's time (prefill included), as Spec-Bench."""
        return self.num_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_s(self) -> float:
        return max(self.total_s - self.ttft_s, 0.0)


@dataclass
class BatchRun:
    """Several requests submitted at once: their wall time from submission to the last one finishing."""

    batch_size: int
    prompts: list[int]
    wall_s: float
    num_tokens: int  # generated tokens, all requests together

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class Entry:
    """Everything measured for one configuration or peer."""

    name: str
    engine: str  # "specair", "transformers", "llama.cpp" or "OpenVINO GenAI"
    baseline: str  # the entry whose per-prompt speed this one's speedup is measured against
    runner: dict[str, Any]  # how to rebuild it (run.make_runner input)
    samples: list[Sample] = field(default_factory=list)
    batches: list[BatchRun] = field(default_factory=list)
    peak_rss_bytes: int | None = None
    notes: list[str] = field(default_factory=list)


def _paired(a: Sequence[Sample], b: Sequence[Sample]) -> list[tuple[Sample, Sample]]:
    """Samples of two entries on the same (round, prompt), in a's order."""
    by_key = {(s.round, s.prompt): s for s in b}
    return [(s, by_key[(s.round, s.prompt)]) for s in a if (s.round, s.prompt) in by_key]


def speedups(samples: Sequence[Sample], baseline: Sequence[Sample], decode_only: bool = False) -> list[float]:
    """Per-prompt speedups over the baseline: tokens/s ratio on each shared (round, prompt)."""
    out = []
    for s, b in _paired(samples, baseline):
        if decode_only:
            num = (s.num_tokens - 1) / s.decode_s if s.decode_s > 0 and s.num_tokens > 1 else 0.0
            den = (b.num_tokens - 1) / b.decode_s if b.decode_s > 0 and b.num_tokens > 1 else 0.0
        else:
            num, den = s.tokens_per_s, b.tokens_per_s
        if den > 0 and num > 0:
            out.append(num / den)
    return out


def pooled_tokens_per_s(samples: Sequence[Sample]) -> float:
    """All generated tokens over all request time."""
    t = sum(s.total_s for s in samples)
    return sum(s.num_tokens for s in samples) / t if t > 0 else 0.0


def pooled_decode_tokens_per_s(samples: Sequence[Sample]) -> float:
    """Tokens after the first over the time after the first token."""
    t = sum(s.decode_s for s in samples)
    return sum(max(s.num_tokens - 1, 0) for s in samples) / t if t > 0 else 0.0


def tau(samples: Sequence[Sample]) -> float | None:
    """Mean tokens per target pass, pooled over requests (bonus token included).

    From the speculative stats where they saw a draft ((accepted + drafts) / drafts), else from counted
    target passes (tokens after the first / passes); None when neither is known.
    """
    specs = [s.spec for s in samples if s.spec]
    drafts = sum(s["num_drafts"] for s in specs)
    if drafts:
        return (sum(s["num_accepted_tokens"] for s in specs) + drafts) / drafts
    known = [s for s in samples if s.target_passes is not None]
    passes = sum(s.target_passes for s in known)
    if not known or passes == 0:
        return None
    return sum(max(s.num_tokens - 1, 0) for s in known) / passes


def acceptance_by_position(samples: Sequence[Sample]) -> list[float] | None:
    """Fraction of speculative steps whose draft token at depth i (1-based position i+1) was accepted."""
    specs = [s.spec for s in samples if s.spec and s.spec.get("accepted_per_position") is not None]
    if not specs:
        return None
    drafts = sum(s["num_drafts"] for s in specs)
    depth = max(len(s["accepted_per_position"]) for s in specs)
    totals = [sum(s["accepted_per_position"][i] for s in specs if i < len(s["accepted_per_position"]))
              for i in range(depth)]
    return [t / drafts if drafts else 0.0 for t in totals]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(samples: Sequence[Sample], reference: Sequence[Sample]) -> dict[str, Any] | None:
    """Token-level agreement with the reference outputs: tokens before the first divergence over the
    longer output's length (pooled), and how many outputs are identical."""
    pairs = _paired(samples, reference)
    if not pairs:
        return None
    matched = sum(common_prefix(s.token_ids, r.token_ids) for s, r in pairs)
    total = sum(max(s.num_tokens, r.num_tokens) for s, r in pairs)
    return {"token_agreement": matched / total if total else 1.0,
            "identical": sum(s.token_ids == r.token_ids for s, r in pairs), "compared": len(pairs)}


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarize(entries: Sequence[Entry], reference: str, greedy: bool) -> dict[str, dict[str, Any]]:
    """Per-entry metrics. `reference` names the specair autoregressive entry that every output is
    compared with and that the cross-engine speedup is taken against."""
    by_name = {e.name: e for e in entries}
    ref = by_name[reference]
    out: dict[str, dict[str, Any]] = {}
    for e in entries:
        base = by_name[e.baseline]
        sp = speedups(e.samples, base.samples)
        sp_ref = speedups(e.samples, ref.samples)
        tpots = [s.decode_s / (s.num_tokens - 1) for s in e.samples if s.num_tokens > 1]
        batch: dict[int, dict[str, float]] = {}
        for b in sorted({r.batch_size for r in e.batches}):
            runs = [r for r in e.batches if r.batch_size == b]
            wall = sum(r.wall_s for r in runs)
            batch[b] = {"tokens_per_s": sum(r.num_tokens for r in runs) / wall if wall > 0 else 0.0,
                        "requests": sum(len(r.prompts) for r in runs)}
        out[e.name] = {
            "engine": e.engine,
            "baseline": e.baseline,
            "requests": len(e.samples),
            "generated_tokens": sum(s.num_tokens for s in e.samples),
            "tokens_per_s": pooled_tokens_per_s(e.samples),
            "decode_tokens_per_s": pooled_decode_tokens_per_s(e.samples),
            "speedup": _mean(sp),
            "speedup_per_prompt": sp,
            "decode_speedup": _mean(speedups(e.samples, base.samples, decode_only=True)),
            "speedup_vs_reference": _mean(sp_ref),
            "tau": tau(e.samples),
            "acceptance_by_position": acceptance_by_position(e.samples),
            "ttft_ms": 1e3 * statistics.fmean(s.ttft_s for s in e.samples) if e.samples else None,
            "tpot_ms": 1e3 * statistics.fmean(tpots) if tpots else None,
            "peak_rss_mb": e.peak_rss_bytes / 2**20 if e.peak_rss_bytes else None,
            "greedy_agreement": agreement(e.samples, ref.samples) if greedy else None,
            "batch": batch,
            "notes": e.notes,
        }
    return out


# ---------------------------------------------------------------- outputs


def write_json(path: Path, report: dict[str, Any], entries: Sequence[Entry]) -> None:
    """The whole report plus every raw sample, so any metric can be recomputed."""
    raw = {e.name: {"runner": e.runner, "samples": [asdict(s) for s in e.samples],
                    "batches": [asdict(b) for b in e.batches]} for e in entries}
    path.write_text(json.dumps({**report, "raw": raw}, indent=1, default=str) + "\n")


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{spec}}{suffix}"


def markdown_table(summary: dict[str, dict[str, Any]]) -> str:
    """One row per configuration: the numbers the README's Performance section shows."""
    head = ("| configuration | engine | tok/s | speedup | × specair AR | τ | acceptance by position | "
            "TTFT ms | TPOT ms | peak RSS MB | greedy agreement |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, m in summary.items():
        acc = m["acceptance_by_position"]
        agree = m["greedy_agreement"]
        agree_s = (f"{agree['token_agreement']:.2f} ({agree['identical']}/{agree['compared']} identical)"
                   if agree else "–")
        lines.append("| " + " | ".join([
            name, m["engine"], _fmt(m["tokens_per_s"], ".1f"), _fmt(m["speedup"], ".2f", "×"),
            _fmt(m["speedup_vs_reference"], ".2f", "×"), _fmt(m["tau"]),
            " / ".join(f"{a:.2f}" for a in acc) if acc else "–",
            _fmt(m["ttft_ms"], ".0f"), _fmt(m["tpot_ms"], ".1f"), _fmt(m["peak_rss_mb"], ".0f"), agree_s,
        ]) + " |")
    return "\n".join(lines)


def batch_table(summary: dict[str, dict[str, Any]]) -> str | None:
    """Tokens/s (all requests together) per batch size, when a sweep ran."""
    sizes = sorted({b for m in summary.values() for b in m["batch"]})
    if not sizes:
        return None
    lines = ["| configuration | " + " | ".join(f"batch {b} tok/s" for b in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for name, m in summary.items():
        if m["batch"]:
            lines.append(f"| {name} | " + " | ".join(_fmt(m["batch"].get(b, {}).get("tokens_per_s"), ".1f")
                                                     for b in sizes) + " |")
    return "\n".join(lines)


def markdown_report(report: dict[str, Any]) -> str:
    """The Markdown file: what ran where, the table, notes."""
    env, s = report["environment"], report["summary"]
    bw = report.get("bandwidth_floor") or {}
    lines = [f"# specair bench — {report['model']}", "",
             f"`{report['command']}`", "",
             (f"Machine: {env.get('cpu')} ({env.get('usable_cpus')} usable of {env.get('logical_cpus')} logical CPUs, "
             f"{env.get('torch_threads')} torch threads, load average {env.get('loadavg_start')} at start), "
             f"{env.get('platform')}. torch {env['versions'].get('torch')}, transformers "
             f"{env['versions'].get('transformers')}, onnxruntime {env['versions'].get('onnxruntime')}, "
             f"llama-cpp-python {env['versions'].get('llama_cpp_python')}, OpenVINO GenAI "
             f"{env['versions'].get('openvino_genai')} (optimum-intel {env['versions'].get('optimum_intel')})."), "",
             (f"{report['num_prompts']} prompts × {report['rounds']} round(s), "
             f"{'greedy' if report['greedy'] else 'sampling ' + json.dumps(report['sampling'])}, "
             f"max {report['max_tokens']} new tokens{' (EOS ignored)' if report['ignore_eos'] else ''}, "
             "batch 1, every configuration interleaved prompt by prompt after a warm-up."), "",
             markdown_table(s), ""]
    if bw:
        lines += [f"Bandwidth floor: {bw['weight_bytes_per_token'] / 1e6:.0f} MB of weights read per token / "
                  f"{bw['read_bandwidth_GB_s']:.1f} GB/s read bandwidth (median of readings through the run) = "
                  f"{bw['floor_tokens_per_s']:.1f} tok/s ({bw['floor_ms_per_token']:.1f} ms per token)"
                  + (f"; the reference autoregressive decode runs at {bw['reference_decode_tokens_per_s']:.1f} "
                     f"tok/s, {bw['floor_over_reference']:.2f}× the floor's time per token"
                     if bw.get("reference_decode_tokens_per_s") else "") + ".", ""]
    bt = batch_table(s)
    if bt:
        lines += ["Batch sweep (requests submitted together; tokens/s of all of them):", "", bt, ""]
    lines += [("Columns: tok/s = generated tokens / request time (prefill included), pooled; speedup = over the "
              "entry's own autoregressive baseline, per prompt then mean (Spec-Bench); × specair AR = the same "
              "against specair's reference autoregressive run; τ = tokens per target pass (bonus included); "
              "acceptance by position = fraction of speculative steps whose i-th draft token was accepted; "
              "TTFT = time to first token; TPOT = time per output token after the first; peak RSS = "
              f"{report['memory_method']}; greedy agreement = tokens before the first divergence from "
              "specair's autoregressive output / the longer output, pooled."), ""]
    for name, prof in (report.get("profiles") or {}).items():
        lines += [profile_markdown(name, prof), ""]
    if report.get("notes"):
        lines += ["Notes:", ""] + [f"- {n}" for n in report["notes"]] + [""]
    if report.get("plots"):
        lines += ["Plots: " + ", ".join(f"`{p}`" for p in report["plots"]), ""]
    return "\n".join(lines)


def profile_markdown(name: str, prof: dict[str, Any]) -> str:
    """Where one request's time went, per graph kind and per operator."""
    lines = [f"Profile of `{name}` (one request of {prof['generated_tokens']} tokens, {prof['steps']} target "
             f"passes after the first token, {prof['ms_per_step']:.1f} ms per pass; host-side work outside the "
             f"graphs {prof['host_ms_per_step']:.1f} ms per pass):", "",
             "| graph | calls | ms per call | ms per pass |", "|---|---|---|---|"]
    for kind, g in prof["graphs"].items():
        lines.append(f"| {kind} | {g['calls']} | {g['ms_per_call']:.1f} | {_fmt(g['ms_per_step'], '.1f')} |")
    ops = ", ".join(f"{o['op']} {o['self_ms_per_step']:.1f}" for o in prof["top_ops"][:6])
    lines += ["", f"Operators (torch.profiler, self CPU ms per pass, prefill included): {ops}; matrix "
              f"multiplies are {100 * prof['matmul_share_of_op_time']:.0f}% of operator time, "
              f"{prof['ops_per_step']:.0f} operator calls per pass."]
    return "\n".join(lines)


def save(fig: Any, path: Path) -> Path:
    """Write a figure as PNG and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(summary: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    """speedup.png, acceptance.png and (with a batch sweep) batch.png; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    written = []
    colors = {"specair": "tab:blue", "transformers": "tab:orange", "llama.cpp": "tab:green",
              "OpenVINO GenAI": "tab:purple"}
    names = list(summary)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.45 * len(names) + 1.8), sharey=True)
    ys = range(len(names))
    for y, n in zip(ys, names):
        m = summary[n]
        c = colors.get(m["engine"], "tab:gray")
        ax1.barh(y, m["speedup"] or 0, color=c, alpha=0.75)
        ax2.barh(y, m["tokens_per_s"], color=c, alpha=0.75)
        pts = [] if m["baseline"] == n else m["speedup_per_prompt"]  # a baseline's own dots are all 1
        ax1.scatter(pts, [y] * len(pts), s=6, color="black", alpha=0.5, zorder=3)
    ax1.axvline(1.0, color="black", lw=0.8)
    ax1.set_yticks(list(ys), names, fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xlabel("speedup over own autoregressive: per prompt (dots), mean (bar)")
    ax2.set_xlabel("tokens/s (end to end, pooled)")
    handles = [Patch(color=c, alpha=0.75, label=eng) for eng, c in colors.items()
               if any(m["engine"] == eng for m in summary.values())]
    ax2.legend(handles=handles, loc="lower right", fontsize=8)
    written.append(save(fig, out_dir / "speedup.png"))

    acc = {n: m["acceptance_by_position"] for n, m in summary.items() if m["acceptance_by_position"]}
    if acc:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for n, a in acc.items():
            ax.plot(range(1, len(a) + 1), a, marker="o", label=n)
        ax.set_xticks(range(1, max(map(len, acc.values())) + 1))
        ax.set_xlabel("draft position (depth)")
        ax.set_ylabel("acceptance rate (per speculative step)")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        written.append(save(fig, out_dir / "acceptance.png"))

    batched = {n: m["batch"] for n, m in summary.items() if len(m["batch"]) > 1}
    if batched:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for n, b in batched.items():
            sizes = sorted(b)
            ax.plot(sizes, [b[s]["tokens_per_s"] for s in sizes], marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({s for b in batched.values() for s in b}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("batch size (requests submitted together)")
        ax.set_ylabel("tokens/s, all requests")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        written.append(save(fig, out_dir / "batch.png"))
    return written
