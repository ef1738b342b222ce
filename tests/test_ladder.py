"""`specair bench --ladder`: its random-weight checkpoints have the shapes they claim and say they are speed only;
a rung's figures (per-configuration floors, ratios to the best peer) come out of a real bench run, into a table
and plots labelled "speed only"; with llama-cpp-python installed, llama.cpp's own converter and quantizer make
a Q4_K_M file that specair reads as stored."""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import replace

import pytest

from specair.benchmarks import ladder
from specair.benchmarks import run as bench
from specair.models.checkpoint import describe, expected_shapes, load_checkpoint
from specair.models.config import ModelConfig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ladder.Rung("tiny-qwen3", "Qwen3 tiny shapes", real=False, arch="qwen3", config=dict(
    vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=128, max_position_embeddings=512, rope_theta=1e6, rms_norm_eps=1e-6,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, hidden_act="silu"))


def test_ladder_rungs_are_the_real_shapes():
    shapes = {r.name: r.config for r in ladder.RUNGS if not r.real}
    assert shapes["qwen3-1.7b"]["num_hidden_layers"] == 28 and shapes["qwen3-1.7b"]["head_dim"] == 128
    assert shapes["qwen3-1.7b"]["vocab_size"] == 151936 and shapes["smollm2-1.7b"]["intermediate_size"] == 8192
    assert shapes["smollm2-360m"]["num_attention_heads"] == 15 and shapes["smollm2-360m"]["num_key_value_heads"] == 5
    assert [r.name for r in ladder.RUNGS if r.real] == ["smollm2-135m"]


@pytest.fixture(scope="module")
def tiny_rung(tmp_path_factory, default_hf_dir):
    return ladder.write_random_checkpoint(TINY, tmp_path_factory.mktemp("rung") / "hf")


def test_random_checkpoint_has_the_rung_shapes_and_says_it_is_speed_only(tiny_rung):
    cfg = ModelConfig.from_hf(json.loads((tiny_rung / "config.json").read_text()))
    assert cfg.model_type == "qwen3" and cfg.head_dim == 128 and cfg.qk_norm
    assert describe(tiny_rung).num_params == sum(math.prod(s) for s in expected_shapes(cfg).values())
    ckpt = load_checkpoint(tiny_rung, progress=False)
    assert ckpt.tokenizer is not None and "speed" in (tiny_rung / "README.md").read_text()
    assert ladder.write_random_checkpoint(TINY, tiny_rung) == tiny_rung  # cached: not written again


def test_rung_figures_table_and_plots_from_a_real_bench_run(tiny_rung, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in bench.load_prompt_set(bench.DEFAULT_PROMPTS)[:2]))
    opts = bench.BenchOptions(model=str(tiny_rung), prompts=str(prompts), max_tokens=4, ignore_eos=True,
                              warmup_tokens=2, peers="none", memory=False, progress=False, plots=False,
                              config_entries=[{"speculative_config": None, "backend": "eager", "name": ladder.DEFAULTS},
                                              {"speculative_config": None, "backend": "eager", "dtype": "fp64",
                                               "name": ladder.Q4KM}],
                              out=str(tmp_path / "run"), command="specair bench --ladder")
    report = bench.run_bench(opts)
    files = ladder.RungFiles(tiny_rung, str(tiny_rung), tmp_path / "a.gguf", tmp_path / "b.gguf")
    row = ladder.rung_row(TINY, files, report)
    assert row["label"] == f"Qwen3 tiny shapes ({ladder.SPEED_ONLY})" and not row["real_weights"]
    e = row["entries"][ladder.DEFAULTS]
    # float32 weights: 4 bytes a parameter (the tied table once), read at the measured bandwidth
    assert e["bytes_per_token"] == 4 * describe(tiny_rung).num_params
    assert e["floor_ms_per_token"] == pytest.approx(1e3 * e["bytes_per_token"] / (row["bandwidth_GB_s"] * 1e9))
    assert e["over_floor"] == pytest.approx(e["tpot_ms"] / e["floor_ms_per_token"])
    assert row["entries"][ladder.Q4KM]["bytes_per_token"] == 2 * e["bytes_per_token"]  # float64
    table = {"command": "specair bench --ladder", "threads": 2, "rungs": [row]}
    md = ladder.ladder_markdown(table)
    assert ladder.SPEED_ONLY in md and f"| {ladder.DEFAULTS} |" in md
    paths = ladder.plot_ladder(table, tmp_path)
    assert [p.read_bytes()[:8] for p in paths] == [PNG_MAGIC, PNG_MAGIC]


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama.cpp's converter and quantizer need llama-cpp-python (pip install "
                           "llama-cpp-python==0.3.36, ~7 min of compiling)")
def test_llama_cpps_own_quantizer_makes_a_file_specair_reads_as_stored(tiny_rung, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECAIR_CACHE", str(tmp_path / "cache"))
    from specair.models.default_model import cache_dir

    rung = replace(TINY, name="tiny")
    (cache_dir() / "ladder" / "tiny").mkdir(parents=True)
    (cache_dir() / "ladder" / "tiny" / "hf").symlink_to(tiny_rung)
    files = ladder.prepare(rung, cache_dir(), 2)
    info = describe(files.q4_k_m)
    assert {"Q4_K", "Q6_K"} <= info.quantized_types and describe(files.q4_1).quantized_types >= {"Q4_1"}
    ckpt = load_checkpoint(files.q4_k_m, progress=False)
    assert ckpt.config.model_type == "qwen3" and ckpt.stored["model.layers.0.mlp.up_proj.weight"].type == "Q4_K"
