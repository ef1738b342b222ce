"""`specair bench`: the metrics on hand-made timings, configuration parsing, the shipped prompt set, and
one end-to-end run on a tiny model with the real tokenizer (autoregressive, a layer-skip configuration
and the transformers peer) that writes JSON, Markdown and PNG files."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from specair.benchmarks import run as bench
from specair.benchmarks.report import (Entry, Sample, acceptance_by_position, agreement, markdown_table,
                                       plot_all, speedups, summarize, tau)
from specair.models.errors import InputError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _spec(drafts: int, accepted: int, per_position: list[int]) -> dict:
    return {"num_drafts": drafts, "num_draft_tokens": drafts * len(per_position), "num_accepted_tokens": accepted,
            "accepted_per_position": per_position, "mean_accepted_length": (accepted + drafts) / drafts}


def hand_made_entries() -> list[Entry]:
    """Autoregressive at 10 and 5 tok/s on two prompts; a speculative config at 20 and 20 tok/s (2x and 4x);
    a peer measured against its own baseline."""
    ar = Entry("ar", "specair", "ar", {}, [
        Sample(0, 0, list(range(10)), ttft_s=0.1, total_s=1.0),
        Sample(1, 0, list(range(20)), ttft_s=0.2, total_s=4.0)])
    spec_out = list(range(15)) + [99, 98, 97, 96, 95]  # diverges from autoregressive at token 15 of 20
    sp = Entry("spec", "specair", "ar", {}, [
        Sample(0, 0, list(range(10)), ttft_s=0.1, total_s=0.5, spec=_spec(3, 6, [3, 2, 1])),
        Sample(1, 0, spec_out, ttft_s=0.05, total_s=1.0, spec=_spec(5, 14, [5, 5, 4]))])
    peer = Entry("peer", "transformers", "peer", {}, [
        Sample(0, 0, list(range(10)), ttft_s=0.1, total_s=2.0, target_passes=9),
        Sample(1, 0, list(range(20)), ttft_s=0.1, total_s=2.0, target_passes=19)])
    peer_pld = Entry("peer pld", "transformers", "peer", {}, [
        Sample(0, 0, list(range(10)), ttft_s=0.1, total_s=1.0, target_passes=3),
        Sample(1, 0, list(range(20)), ttft_s=0.1, total_s=1.0, target_passes=5)])
    return [ar, sp, peer, peer_pld]


def test_metrics_on_hand_made_timings():
    ar, sp, peer, pld = hand_made_entries()
    # Spec-Bench: per-prompt ratios (2x, 4x), then the mean — not the pooled ratio (20 / 6 = 3.33x).
    assert speedups(sp.samples, ar.samples) == pytest.approx([2.0, 4.0])
    s = summarize([ar, sp, peer, pld], reference="ar", greedy=True)
    assert s["spec"]["speedup"] == pytest.approx(3.0)
    assert s["spec"]["tokens_per_s"] == pytest.approx(30 / 1.5)
    assert s["ar"]["speedup"] == pytest.approx(1.0)
    # Decode-only: (9 / 0.4) / (9 / 0.9) and (19 / 0.95) / (19 / 3.8).
    assert s["spec"]["decode_speedup"] == pytest.approx((0.9 / 0.4 + 3.8 / 0.95) / 2)
    # tau pooled over requests: (6 + 14 accepted + 8 bonus) / 8 drafts; acceptance per depth over 8 steps.
    assert tau(sp.samples) == pytest.approx(28 / 8)
    assert acceptance_by_position(sp.samples) == pytest.approx([8 / 8, 7 / 8, 5 / 8])
    assert s["ar"]["tau"] is None and s["ar"]["acceptance_by_position"] is None
    # A speculative run that never found a draft (n-gram without matches) made one token per pass.
    no_draft = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_position": [0, 0]}
    assert tau([Sample(0, 0, [1, 2, 3, 4, 5], 0.1, 0.5, target_passes=4, spec=no_draft)]) == 1.0
    # Peers: tau from counted target passes, speedup over their own baseline and over specair's.
    assert s["peer pld"]["tau"] == pytest.approx((9 + 19) / (3 + 5))
    assert s["peer"]["tau"] == pytest.approx(1.0)
    assert s["peer pld"]["speedup"] == pytest.approx(2.0)
    assert s["peer pld"]["speedup_vs_reference"] == pytest.approx((10 / 10 + 20 / 5) / 2)
    # TTFT mean and time per output token after the first.
    assert s["spec"]["ttft_ms"] == pytest.approx(75.0)
    assert s["spec"]["tpot_ms"] == pytest.approx(1e3 * (0.4 / 9 + 0.95 / 19) / 2)
    # Greedy agreement: 10 + 15 matching tokens of 10 + 20, one output identical.
    assert s["spec"]["greedy_agreement"] == {"token_agreement": pytest.approx(25 / 30), "identical": 1,
                                            "compared": 2}
    assert agreement(ar.samples, ar.samples)["token_agreement"] == 1.0
    assert summarize([ar, sp], "ar", greedy=False)["spec"]["greedy_agreement"] is None


def test_markdown_and_plots(tmp_path):
    entries = hand_made_entries()
    s = summarize(entries, "ar", greedy=True)
    table = markdown_table(s)
    rows = table.splitlines()
    assert len(rows) == 2 + len(entries) and all(r.count("|") == rows[0].count("|") for r in rows)
    assert "| spec | specair | 20.0 | 3.00× | 3.00× | 3.50 | 1.00 / 0.88 / 0.62 |" in table
    assert "0.83 (1/2 identical)" in table
    files = plot_all(s, tmp_path)
    assert [f.name for f in files] == ["speedup.png", "acceptance.png"]  # no batch sweep, no batch plot
    assert all(f.read_bytes()[:8] == PNG_MAGIC for f in files)


def test_parse_configs_expands_and_adds_baselines():
    ls = {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2}
    cfgs = bench.parse_configs([ls], backends=("eager", "inductor"), acceptances=("exact", "typical"))
    names = [c.label for c in cfgs]
    # An autoregressive baseline per backend, first; each spec crossed with backends and acceptances.
    assert names[:2] == ["autoregressive", "autoregressive [inductor]"]
    # The plain eager fp32 baseline leads (it is the reference) even when listed after another.
    mixed = bench.parse_configs([{"speculative_config": ls, "backend": "onnx", "quantize": "int4"}, None])
    assert [c.label for c in mixed][:2] == ["autoregressive", "autoregressive [onnx int4]"]
    assert len(cfgs) == 2 + 4
    assert "layer_skip k=2 num_layers=1 acceptance=typical [inductor]" in names
    explicit = bench.parse_configs([None, {"speculative_config": ls, "backend": "eager", "name": "mine"}])
    assert [c.label for c in explicit] == ["autoregressive", "mine"]
    # Quantized weights are other arithmetic: their speculative configs get a quantized baseline.
    q = bench.parse_configs([{"speculative_config": ls, "backend": "onnx", "quantize": "int4"}])
    assert [c.label for c in q] == ["autoregressive [onnx int4]", "layer_skip k=2 num_layers=1 [onnx int4]"]
    assert q[0].baseline_key == q[1].baseline_key == ("onnx", "fp32", "int4", 1, None)
    with pytest.raises(InputError, match="num_speculative_tokens"):
        bench.parse_configs([{"method": "layer_skip", "num_layers": 1}])
    with pytest.raises(InputError, match="share the name"):
        bench.parse_configs([ls, ls])
    with pytest.raises(InputError, match="unknown configuration key"):
        bench.parse_configs([{"speculative_config": ls, "threads": 2}])


def test_default_configurations_lead_with_the_main_job():
    """`specair bench` with no --configs measures what `specair generate` runs with no flags (backend and
    speculation `auto`, resolved by the engine), beside its own plain-decoding baseline on that backend."""
    cfgs = bench.parse_configs(bench.default_config_entries(None), acceptances=("exact", "typical"))
    assert cfgs[0].label == "autoregressive" and cfgs[0].backend == "eager"  # the reference
    speculative = [c for c in cfgs if c.speculative_config is not None]
    main = speculative[0]
    assert (main.label, main.backend, main.speculative_config) == ("main job (generate's defaults)", "auto", "auto")
    assert sum(c.speculative_config == "auto" for c in cfgs) == 1  # not crossed with acceptance methods
    assert any(c.speculative_config is None and c.baseline_key == main.baseline_key for c in cfgs)


def test_shipped_prompt_set():
    recs = bench.load_prompt_set(bench.DEFAULT_PROMPTS)
    assert 24 <= len(recs) <= 36
    cats = {r["category"] for r in recs}
    assert cats == {"chat", "code", "summarisation", "translation", "maths", "retrieval"}
    assert len({r["id"] for r in recs}) == len(recs)
    assert any(len(r["messages"]) > 1 for r in recs)  # a multi-turn chat


def test_bad_prompt_file_is_refused(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "no"}\n')
    with pytest.raises(InputError, match="p.jsonl:2"):
        bench.load_prompt_set(bad)


def test_one_prompt_file_reader_for_generate_bench_and_training(tmp_path):
    """`runtime.prompts.read_prompt_file` is what `specair generate --prompts`, `specair bench` and
    `specair train` read: blank lines skipped, line numbers kept, every record checked, chat-only where asked."""
    from specair.runtime.prompts import read_prompt_file
    from specair.training.prompt_set import load_prompts

    chat = '{"messages": [{"role": "user", "content": "hi"}], "category": "c"}'
    f = tmp_path / "p.jsonl"
    f.write_text(f'{chat}\n\n{{"prompt": "text"}}\n')
    assert [(n, sorted(r)) for n, r in read_prompt_file(f)] == [(1, ["category", "messages"]), (3, ["prompt"])]
    with pytest.raises(InputError, match=r"p.jsonl:3: expected \{\"messages\"") as e:
        read_prompt_file(f, chat_only=True)
    assert "prompt" not in str(e.value).split("expected")[1]
    with pytest.raises(InputError, match="p.jsonl:3"):
        load_prompts(f)
    assert [r["id"] for r in bench.load_prompt_set(f)] == ["prompt-1", "prompt-2"]
    for bad, where in (('{"messages": []}', "p.jsonl:1"), ("[1, 2]", "p.jsonl:1"), ("{", "not valid JSON")):
        f.write_text(bad + "\n")
        with pytest.raises(InputError, match=where):
            read_prompt_file(f)
    with pytest.raises(InputError, match="cannot read prompts file"):
        read_prompt_file(tmp_path / "missing.jsonl")


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory, default_hf_dir) -> Path:
    from helpers import save_tiny

    path = tmp_path_factory.mktemp("tiny-bench")
    save_tiny("llama", path, vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (default_hf_dir / name).is_file():
            shutil.copy(default_hf_dir / name, path / name)
    return path


def test_end_to_end_on_a_tiny_model(tiny_with_tokenizer, tmp_path):
    pytest.importorskip("transformers")
    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps([None, {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2}]))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in bench.load_prompt_set(bench.DEFAULT_PROMPTS)[:2]))
    parser = argparse.ArgumentParser()
    bench.add_bench_parser(parser.add_subparsers())
    out = tmp_path / "out"
    args = parser.parse_args(["bench", "--model", str(tiny_with_tokenizer), "--prompts", str(prompts),
                              "--configs", str(configs), "--peers", "hf", "--max-tokens", "6", "--ignore-eos",
                              "--batch-sizes", "1,2", "--warmup-tokens", "2", "--out", str(out), "--no-progress",
                              "--no-memory", "--profile"])
    args.func(args)

    report = json.loads((out / "results.json").read_text())
    s = report["summary"]
    assert list(s) == ["autoregressive", "layer_skip k=2 num_layers=1", "transformers"]
    assert s["transformers"]["baseline"] == "transformers"
    for name, m in s.items():
        assert m["requests"] == 2 and m["generated_tokens"] == 12, name
        assert m["tokens_per_s"] > 0 and m["ttft_ms"] > 0 and m["tpot_ms"] > 0
        # Greedy speculative decoding is lossless; transformers on the same fp32 weights agrees too.
        assert m["greedy_agreement"]["token_agreement"] == 1.0, name
        assert m["peak_rss_mb"] is None, name  # --no-memory; the probe has its own test
        assert set(m["batch"]) == {"1", "2"}, name
    spec = s["layer_skip k=2 num_layers=1"]
    assert 1.0 <= spec["tau"] <= 3.0 and len(spec["acceptance_by_position"]) == 2
    assert spec["speedup"] == pytest.approx(sum(spec["speedup_per_prompt"]) / 2)
    raw = report["raw"]["layer_skip k=2 num_layers=1"]["samples"]
    assert sum(r["spec"]["num_drafts"] for r in raw) > 0
    env = report["environment"]
    assert env["versions"]["torch"] and env["cpu"] and env["torch_threads"] >= 1
    assert report["bandwidth_floor"]["floor_tokens_per_s"] > 0
    # --profile: the reference and the best speculative configuration, split by graph kind.
    prof = report["profiles"]
    assert set(prof) == {"autoregressive", "layer_skip k=2 num_layers=1"}
    assert {"prefill", "decode"} <= set(prof["autoregressive"]["graphs"])
    assert {"draft", "verify"} <= set(prof["layer_skip k=2 num_layers=1"]["graphs"])  # verify: scoring and acceptance
    assert prof["autoregressive"]["top_ops"] and 0 < prof["autoregressive"]["matmul_share_of_op_time"] <= 1
    md = (out / "results.md").read_text()
    assert "Profile of `layer_skip k=2 num_layers=1`" in md
    assert "| layer_skip k=2 num_layers=1 | specair |" in md and "Bandwidth floor" in md
    for png in ("speedup.png", "acceptance.png", "batch.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC


def test_memory_probe_builds_the_configuration_in_a_fresh_process(tiny_with_tokenizer):
    from specair.runtime.params import SamplingParams

    spec = {"kind": "specair", "model": str(tiny_with_tokenizer), "config": {"speculative_config": None},
            "max_context": 256, "batch_buckets": [1], "threads": None}
    peak = bench.probe_peak_rss(spec, [1, 2, 3], SamplingParams(max_tokens=2), None)
    assert peak is not None and 50 * 2**20 < peak < 8 * 2**30
    broken = {**spec, "model": str(tiny_with_tokenizer / "missing")}
    assert bench.probe_peak_rss(broken, [1, 2, 3], SamplingParams(max_tokens=2), None) is None


def test_artifact_configurations_take_their_plan_from_the_manifest(tiny_with_tokenizer, tmp_path):
    from specair.runtime.build import compile_plan

    art = tmp_path / "ngram-art"
    compile_plan(str(tiny_with_tokenizer), "fp32", '{"method": "ngram", "num_speculative_tokens": 2}', "eager",
                 str(art), (1,), 128, ("greedy",), 64, None)
    cfgs = bench.parse_configs([None, {"artifacts": str(art)}])
    assert [c.label for c in cfgs] == ["autoregressive", "ngram k=2 prompt_lookup_min=2 prompt_lookup_max=4"]
    c = cfgs[1]
    assert (c.backend, c.dtype, c.quantize, c.speculative_config["method"]) == ("eager", "fp32", None, "ngram")
    assert c.baseline_key == cfgs[0].baseline_key  # same arithmetic: eager autoregressive is its baseline
    with pytest.raises(InputError, match="was compiled for"):
        bench.parse_configs([{"artifacts": str(art), "speculative_config": {"method": "ngram",
                                                                           "num_speculative_tokens": 3}}])
    with pytest.raises(InputError, match="manifest"):
        bench.parse_configs([{"artifacts": str(art), "backend": "onnx"}])


def test_bandwidth_floor_counts_the_weights_as_the_reference_stores_them(tmp_path):
    """fp32: every parameter at 4 bytes (a tied table read whole as the LM head); int4 on specair's kernel: each
    linear weight, the tied head included, at 4 bits plus a float16 scale and minimum per 32."""
    import dataclasses

    import torch
    from helpers import save_tiny

    from specair.compile.quantize import SCHEMES, parse_quantize
    from specair.models.checkpoint import load_checkpoint
    from specair.models.llama import build_model

    save_tiny("llama-tied", tmp_path)
    ckpt = load_checkpoint(tmp_path, progress=False)
    model = build_model(ckpt.config, ckpt.state_dict)
    assert model.output is None
    params = {id(p): p for p in model.parameters()}.values()
    assert bench.weight_bytes_per_token(model) == 4 * sum(p.numel() for p in params)
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)] + [model.tok_embeddings.weight]
    rest = sum(p.numel() for p in params) - sum(w.numel() for w in weights)
    q4 = dataclasses.replace(SCHEMES["int4"], kernel="MatMulBlocks")
    # Q4_1 (5 bits) where K is not a multiple of 256, Q4_K's shape as the kernel lays it out (4.625) where it is
    assert q4.bytes_per_weight(576) == 0.625 and q4.bytes_per_weight(2048) == 4.625 / 8
    assert SCHEMES["int8"].bytes_per_weight(576) == 1.125
    expected = sum(w.numel() * (4.625 if w.shape[1] % 256 == 0 else 5) / 8 for w in weights) + 4 * rest
    assert bench.weight_bytes_per_token(model, q4) == int(expected)
    assert parse_quantize("int4").bytes_per_weight(64) in (0.625, 0.640625)  # specair's kernel, or MatMulNBits
