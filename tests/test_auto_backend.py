"""`--backend auto`: the fastest configuration, compiled ahead of time into specair's cache once and
loaded (lazily, graph by graph) afterwards; and the OpenVINO GenAI benchmark peer."""

import importlib.util
import json

import pytest
from helpers import save_tiny

import specair.runtime.build as build
from specair.compile.artifacts import read_manifest
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


def test_auto_resolves_to_onnx_with_exact_int4_for_the_default_model_only():
    assert auto_backend(None) == ("onnx", "int4")
    assert auto_backend("/some/checkpoint") == ("onnx", None)
    assert auto_backend("/some/checkpoint", "int8") == ("onnx", "int8")


def test_ngram_lookahead_defaults_to_four():
    assert parse_spec(NGRAM).num_speculative_tokens == 4
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
