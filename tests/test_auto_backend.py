"""`--backend auto`: the fastest configuration, compiled ahead of time into specair's cache once and
loaded (lazily, graph by graph) afterwards; and the OpenVINO GenAI benchmark peer."""

import importlib.util
import json
import shutil

import pytest
import torch
from helpers import save_tiny

import specair.runtime.build as build
from specair.compile.artifacts import read_manifest
from specair.models.llama import is_placeholder
from specair.runtime.build import auto_backend, open_engine, parse_spec
from specair.runtime.llm import LLM
from specair.runtime.params import SamplingParams

PROMPT = list(range(5, 30))
NGRAM = '{"method": "ngram"}'


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny("llama", path, max_position_embeddings=256)
    return path


def tokens(engine, n=24):
    return LLM.from_engine(engine).generate(PROMPT, SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids


def test_auto_reads_quantized_files_as_stored_and_keeps_small_float_checkpoints_float(tiny_dir, monkeypatch):
    """The default model (and any quantized GGUF) runs on the int4 kernels; a float checkpoint does from
    AUTO_INT4_MIN_PARAMS on (a toy one stays float32, exactly the model); --quantize overrides."""
    assert auto_backend(None) == ("onnx", "int4")
    assert auto_backend(str(tiny_dir)) == ("onnx", None)
    assert auto_backend(str(tiny_dir), "int8") == ("onnx", "int8")
    monkeypatch.setattr(build, "AUTO_INT4_MIN_PARAMS", 1000)
    assert auto_backend(str(tiny_dir)) == ("onnx", "int4")


def test_ngram_lookahead_defaults_to_three():
    assert parse_spec(NGRAM).num_speculative_tokens == 3
    assert parse_spec('{"method": "ngram", "num_speculative_tokens": 2}').num_speculative_tokens == 2


def test_auto_builds_once_into_the_cache_then_loads_lazily(tiny_dir, tmp_path, monkeypatch):
    """The first engine compiles the plan into $SPECAIR_CACHE/artifacts; the second compiles nothing, loads
    only the graphs it calls, and both give the eager engine's greedy tokens. Other weights get another
    directory."""
    monkeypatch.setenv("SPECAIR_CACHE", str(tmp_path))
    eager = open_engine(str(tiny_dir), spec_json=NGRAM, backend="eager", max_context=128)
    first = open_engine(str(tiny_dir), spec_json=NGRAM, backend="auto", max_context=128)
    (art,) = (tmp_path / "artifacts").iterdir()
    manifest = read_manifest(art)
    assert manifest["backend"] == "onnx" and manifest["plan"]["max_context"] == 128
    assert manifest["plan"]["variants"] == ["greedy", "filtered"]
    expected = tokens(eager)
    assert tokens(first) == expected

    def no_compile(*a, **k):
        raise AssertionError("a cached build was compiled again")

    monkeypatch.setattr(build, "compile_artifacts", no_compile)
    second = open_engine(str(tiny_dir), spec_json=NGRAM, backend="auto", max_context=128)
    assert not second.graphs.fns  # nothing loaded before it is called
    assert tokens(second) == expected
    used = {k.name for k in second.graphs.fns}
    assert used and used < set(manifest["graphs"])  # loaded the graphs it ran, not the whole plan
    monkeypatch.undo()
    monkeypatch.setenv("SPECAIR_CACHE", str(tmp_path))
    other = tmp_path / "other"
    save_tiny("llama", other, seed=5, max_position_embeddings=256)
    open_engine(str(other), spec_json=NGRAM, backend="auto", max_context=128)
    assert len(list((tmp_path / "artifacts").iterdir())) == 2


def test_a_cached_int4_build_opens_without_reading_the_float_weights(tiny_dir, tmp_path, monkeypatch):
    """Graphs that read their own int4 copies open from the cache with the checkpoint's linear weights never read
    (placeholders that hold no memory) and give the first build's tokens; a lazily loaded model whose build is
    gone is loaded whole before it is compiled again."""
    monkeypatch.setenv("SPECAIR_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "AUTO_INT4_MIN_PARAMS", 1000)
    expected = tokens(open_engine(str(tiny_dir), spec_json=NGRAM, backend="auto", max_context=128))
    loads, real = [], build.load_models
    monkeypatch.setattr(build, "load_models", lambda *a, **k: loads.append(k.get("lazy")) or real(*a, **k))
    cached = open_engine(str(tiny_dir), spec_json=NGRAM, backend="auto", max_context=128)
    assert loads == [True]
    linear = [m.weight for m in cached.target.modules() if isinstance(m, torch.nn.Linear)]
    assert linear and all(is_placeholder(w) for w in linear)
    assert tokens(cached) == expected
    (art,) = (tmp_path / "artifacts").iterdir()
    shutil.rmtree(art)
    loads.clear()
    rebuilt = open_engine(str(tiny_dir), spec_json=NGRAM, backend="auto", max_context=128)
    assert loads == [True, False] and read_manifest(art)["backend"] == "onnx"
    assert tokens(rebuilt) == expected


def test_a_broken_cached_build_is_rebuilt(tiny_dir, tmp_path, monkeypatch):
    """A cache entry whose manifest is corrupt (an interrupted or damaged build) is compiled again."""
    monkeypatch.setenv("SPECAIR_CACHE", str(tmp_path))
    open_engine(str(tiny_dir), backend="auto", max_context=64)
    (art,) = (tmp_path / "artifacts").iterdir()
    (art / "manifest.json").write_text("{not json")
    engine = open_engine(str(tiny_dir), backend="auto", max_context=64)
    assert json.loads((art / "manifest.json").read_text())["backend"] == "onnx"
    assert len(tokens(engine, 8)) == 8


@pytest.mark.skipif(importlib.util.find_spec("openvino_genai") is None or importlib.util.find_spec("optimum") is None,
                    reason="the OpenVINO GenAI peer needs the peers extra (openvino-genai, optimum-intel)")
def test_openvino_genai_peer_generates_from_token_ids(default_hf_dir, tmp_path):
    from specair.benchmarks.peers import OpenVinoGenAIPeer, PeerUnavailable
    from specair.models.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(default_hf_dir)
    ids = tok.encode("The capital of France is")
    try:
        peer = OpenVinoGenAIPeer("openvino", str(default_hf_dir), tmp_path, threads=2)
    except PeerUnavailable as e:  # e.g. optimum-intel pins an older transformers than the one installed
        pytest.skip(str(e)[:200])
    (sample,), wall = peer.run([ids], SamplingParams(max_tokens=6, ignore_eos=True), 0, [0])
    assert len(sample.token_ids) == 6 and sample.target_passes == 5 and 0 < sample.ttft_s <= wall
    assert "Paris" in tok.decode(sample.token_ids)


def test_fused_attention_plans_have_one_context_bucket(tiny_dir):
    """Where fused attention covers every graph (onnx; no draft model or head; batch bucket 1 when
    speculating) the plan has one context bucket; a draft, a batch of verifies or eager keep them all."""
    from specair.compile.backends import get_backend
    from specair.compile.backends.onnx import OnnxBackend

    models = build.load_models(str(tiny_dir), "fp32", None)
    onnx, eager = OnnxBackend(), get_backend("eager")
    spec = parse_spec(NGRAM)
    one = build._plan(models.target, spec, 200, "fp32", backend=onnx, draft=None, batch_buckets=(1,))
    assert one.ctx_buckets == (200,)
    assert build._plan(models.target, None, 200, "fp32", backend=onnx, draft=None,
                       batch_buckets=(1, 2)).ctx_buckets == (200,)
    assert len(build._plan(models.target, spec, 200, "fp32", backend=onnx, draft=None,
                           batch_buckets=(1, 2)).ctx_buckets) > 1
    assert len(build._plan(models.target, spec, 200, "fp32", backend=onnx, draft=object(),
                           batch_buckets=(1,)).ctx_buckets) > 1
    assert len(build._plan(models.target, None, 200, "fp32", backend=eager, draft=None).ctx_buckets) > 1
    assert len(build._plan(models.target, None, 200, "fp32", backend=OnnxBackend(self_contained=True),
                           draft=None).ctx_buckets) > 1
    # Smaller prefill chunks where graphs are cheap to have (one context bucket, or eager), not elsewhere.
    assert one.chunk_buckets == (16, 32, 64, 128)
    assert build._plan(models.target, None, 200, "fp32", backend=eager, draft=None).chunk_buckets == (16, 32, 64, 128)
    assert build._plan(models.target, spec, 200, "fp32", backend=onnx, draft=object(),
                       batch_buckets=(1,)).chunk_buckets == (128,)


def test_auto_speculation_is_ngram_only_where_it_cannot_change_the_output():
    """`--speculative-config auto` (generate's and chat's default) is n-gram prompt lookup on row-independent
    graphs (onnx int4 on specair's kernels, float32, batch 1) and plain decoding everywhere else."""
    from specair.compile.backends import get_backend
    from specair.compile.backends.onnx import OnnxBackend
    from specair.runtime.cli import build_parser

    ngram = parse_spec(build.AUTO_SPEC)
    assert ngram.method == "ngram"
    int4 = OnnxBackend(quantize="int4")
    assert int4.row_independent and build.auto_spec(int4, "fp32", (1,)) == ngram
    assert build.auto_spec(int4, "fp32", (1, 4)) is None
    assert build.auto_spec(int4, "bf16", (1,)) is None
    for be in (OnnxBackend(), OnnxBackend(quantize="int8"), get_backend("eager")):
        assert not be.row_independent and build.auto_spec(be, "fp32", (1,)) is None
    int4.kernels = False  # onnxruntime's own MatMulNBits and GroupQueryAttention round verify rows otherwise
    assert not int4.row_independent
    parser = build_parser()
    for cmd in (["generate", "--prompt", "x"], ["chat"]):
        assert parser.parse_args(cmd).speculative_config == "auto"
    assert parser.parse_args(["compile", "--backend", "onnx", "--out", "x"]).speculative_config is None
    assert parse_spec("none") is None and parse_spec("auto") is None  # auto is resolved by open_engine


def test_auto_speculation_gives_plain_decodings_tokens(tiny_dir):
    """On onnx int4 the auto default speculates (and does accept drafts) with plain decoding's greedy tokens."""
    kw = dict(backend="onnx", quantize="int4", max_context=128)
    auto, plain = open_engine(str(tiny_dir), spec_json="auto", **kw), open_engine(str(tiny_dir), spec_json="none", **kw)
    assert auto.proposer.spec.method == "ngram" and plain.proposer is None
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    (a,), (p,) = LLM.from_engine(auto).generate(prompt, params), LLM.from_engine(plain).generate(prompt, params)
    assert a.token_ids == p.token_ids
    assert a.extra["spec"]["mean_accepted_length"] > 1


def test_load_graphs_loads_what_a_request_of_that_sampling_runs(tiny_dir, tmp_path, monkeypatch):
    """`specair generate` loads the graphs its sampling runs before the first request (none lands in its
    timing): greedy loads the prefill, decode and verify graphs of the greedy variant, not the filtered ones."""
    monkeypatch.setenv("SPECAIR_CACHE", str(tmp_path))
    engine = open_engine(str(tiny_dir), spec_json=NGRAM, backend="auto", max_context=64)
    assert engine.load_graphs(SamplingParams()) == len(engine.graphs.fns) > 0
    kinds = {(k.kind, k.method or k.variant) for k in engine.graphs.fns}
    assert {("decode", "greedy"), ("verify", "greedy"), ("prefill", "")} == kinds
    assert engine.load_graphs(SamplingParams()) == 0
    assert engine.load_graphs(SamplingParams(temperature=0.8, top_p=0.9)) > 0
    assert {("decode", "filtered"), ("verify", "filtered")} <= {(k.kind, k.variant) for k in engine.graphs.fns}
