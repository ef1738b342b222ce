"""The bucket plan, the graph catalogue, artifact directories and the CPU compile backends."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import save_tiny

from specair.compile.artifacts import ArtifactError, compile_artifacts, load_artifacts, read_manifest
from specair.compile.backends import BackendUnavailable, get_backend
from specair.compile.catalog import Catalog
from specair.compile.graph_def import GraphKey
from specair.compile.plan import Plan
from specair.compile.spec_config import SpeculativeConfig
from specair.models.checkpoint import load_checkpoint
from specair.models.errors import InputError
from specair.models.llama import build_model, truncated
from specair.runtime.build import engine_from_models, make_proposer
from specair.runtime.engine import Engine
from specair.runtime.llm import LLM
from specair.runtime.params import SamplingParams

CHAIN = SpeculativeConfig.parse({"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2})
TREE = SpeculativeConfig.parse({"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2,
                                "tree": "kary:2x2"})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny("llama", path, max_position_embeddings=128)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    ckpt = load_checkpoint(tiny_dir, progress=False)
    return build_model(ckpt.config, ckpt.state_dict)


def test_plan_buckets_and_fallbacks():
    plan = Plan(max_context=300, batch_buckets=(4, 1, 2), speculative=CHAIN)
    assert plan.ctx_buckets == (64, 128, 256, 300)
    assert plan.batch_buckets == (1, 2, 4)
    assert plan.context_bucket(1) == 64 and plan.context_bucket(129) == 256 and plan.context_bucket(300) == 300
    with pytest.raises(InputError, match="max_context"):
        plan.context_bucket(301)
    assert plan.batch_bucket(3) == 4
    with pytest.raises(InputError, match="largest batch bucket"):
        plan.batch_bucket(5)
    assert plan.variant_for("greedy") == "greedy" and plan.variant_for("plain") == "filtered"
    assert Plan(max_context=64, variants=("filtered",)).variant_for("greedy") == "filtered"
    with pytest.raises(InputError, match="variant"):
        Plan(max_context=64, variants=("greedy",)).variant_for("filtered")
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    assert plan.slots == 300 + 128


def test_every_catalog_graph_runs_eagerly_with_its_example_inputs(tiny):
    for spec in (CHAIN, TREE, SpeculativeConfig.parse({"method": "layer_skip", "num_layers": 1,
                                                       "num_speculative_tokens": 2, "tree": "topk:2x4",
                                                       "acceptance": "typical"})):
        plan = Plan(max_context=128, batch_buckets=(1, 2), variants=("greedy", "plain", "filtered"), speculative=spec)
        cat = Catalog(tiny, plan, make_proposer(plan, tiny, truncated(tiny, 1)))
        keys = cat.keys()
        assert len(keys) == len(set(keys))
        for key in keys:
            g = cat.graph(key)
            out = g.eager(*g.example_inputs)
            assert len(out) == len(g.output_names), key
            assert len(g.example_inputs) == len(g.input_names), key


def test_backends_refuse_clearly():
    with pytest.raises(BackendUnavailable, match="unknown backend"):
        get_backend("tpu")


PROMPT = list(range(5, 30))


def generate(engine, n=24):
    return LLM.from_engine(engine).generate(PROMPT, SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("backend,spec", [("inductor", None), ("inductor", CHAIN), ("inductor", TREE),
                                          ("aoti", CHAIN), ("onnx", CHAIN)],
                         ids=["inductor-autoregressive", "inductor-chain", "inductor-tree", "aoti-chain", "onnx-chain"])
def test_backend_generation_equals_eager(tiny, backend, spec):
    """Graphs compiled on first use by a backend give the eager tokens, and never recompile after."""
    draft = truncated(tiny, 1) if spec is not None else None
    kw = dict(max_context=64, prefill_chunk=16)
    eager = engine_from_models(tiny, None, draft, spec, **kw)
    compiled = engine_from_models(tiny, None, draft, spec, backend=backend, **kw)
    assert generate(compiled) == generate(eager)
    assert generate(compiled, 30) == generate(eager, 30)  # same graphs again: no new compiles needed


def fingerprints():
    return {"target": "abc", "tokenizer": None, "dtype": "fp32", "draft": "layer_skip:1"}


def test_artifacts_roundtrip_and_refusals(tiny, tmp_path):
    plan = Plan(max_context=128, batch_buckets=(1,), prefill_chunk=16, variants=("greedy",), speculative=CHAIN)
    proposer = make_proposer(plan, tiny, truncated(tiny, 1))
    cat = Catalog(tiny, plan, proposer)
    eager = get_backend("eager")
    compile_artifacts(cat, eager, tmp_path, fingerprints(), progress=False)
    manifest = read_manifest(tmp_path)
    assert manifest["graphs"] == [k.name for k in cat.keys()] and manifest["backend"] == "eager"
    graphs = load_artifacts(cat, eager, tmp_path, manifest, fingerprints(), "HINT")
    loaded = Engine(tiny, None, proposer, graphs)
    ref = engine_from_models(tiny, None, truncated(tiny, 1), CHAIN, max_context=128, prefill_chunk=16)
    assert generate(loaded) == generate(ref)
    with pytest.raises(InputError, match="variant 'filtered' is not in the plan"):  # a variant not compiled
        loaded.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=1.0, top_k=5))
    with pytest.raises(ArtifactError, match="not in the compiled plan"):
        graphs(GraphKey("verify", 2, 64, "greedy"))
    with pytest.raises(ArtifactError, match="target differs.*HINT"):
        load_artifacts(cat, eager, tmp_path, manifest, {**fingerprints(), "target": "xyz"}, "HINT")
    # Built by other specair code under the same version number: stale.
    other_code = {**manifest, "versions": {**manifest["versions"], "specair_source": "0" * 16}}
    with pytest.raises(ArtifactError, match="specair_source is [0-9a-f]{16} but they were built with 0{16}.*HINT"):
        load_artifacts(cat, eager, tmp_path, other_code, fingerprints(), "HINT")
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="corrupt"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="no manifest.json"):
        read_manifest(tmp_path)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "specair.runtime.cli", *args], capture_output=True, text=True,
                          timeout=900)


def test_cli_compile_then_generate_from_artifacts(tiny_dir, tmp_path):
    """`specair compile --backend inductor` then `specair generate --artifacts` in fresh processes: the
    second compiles nothing (every Inductor graph is a cache hit) and gives the eager tokens."""
    spec = '{"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2}'
    out = tmp_path / "art"
    r = run_cli("compile", "--model", str(tiny_dir), "--backend", "inductor", "--out", str(out), "--buckets", "1",
                "--max-context", "64", "--variants", "greedy", "--prefill-chunk", "16", "--speculative-config", spec)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["plan"]["max_context"] == 64 and manifest["versions"]["torch"] == torch.__version__
    ids = json.dumps(list(range(5, 25)))
    eager = run_cli("generate", "--backend", "eager", "--model", str(tiny_dir), "--prompt-ids", ids, "--max-tokens", "16", "--json",
                    "--ignore-eos", "--max-context", "64", "--speculative-config", spec)
    assert eager.returncode == 0, eager.stderr
    check = ("import sys, runpy, atexit, json; from torch._dynamo.utils import counters; "
             "atexit.register(lambda: print('COUNTERS', json.dumps(dict(counters['inductor'])), file=sys.stderr)); "
             "sys.argv = ['specair'] + sys.argv[1:]; runpy.run_module('specair.runtime.cli', run_name='__main__')")
    art = subprocess.run([sys.executable, "-c", check, "generate", "--model", str(tiny_dir), "--prompt-ids", ids,
                          "--max-tokens", "16", "--json", "--ignore-eos", "--artifacts", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert art.returncode == 0, art.stderr
    a, e = json.loads(art.stdout), json.loads(eager.stdout)
    assert a["token_ids"] == e["token_ids"] and a["backend"] == "inductor" and e["backend"] == "eager"
    counters = json.loads(art.stderr.split("COUNTERS", 1)[1])
    assert counters.get("fxgraph_cache_hit", 0) >= 1 and counters.get("fxgraph_cache_miss", 0) == 0, counters
    # A plan mismatch is refused with the command that recompiles.
    bad = run_cli("generate", "--model", str(tiny_dir), "--prompt-ids", ids, "--artifacts", str(out),
                  "--max-context", "128")
    assert bad.returncode == 2 and "differs from the compiled plan" in bad.stderr
    other = tmp_path / "other"
    save_tiny("llama", other, seed=3, max_position_embeddings=128)
    bad = run_cli("generate", "--model", str(other), "--prompt-ids", ids, "--artifacts", str(out))
    assert bad.returncode == 2 and "target differs" in bad.stderr and "specair compile" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_cli_onnx_edge_export_passes_check_onnx_and_serves(tiny_dir, tmp_path):
    """The Atlas path: self-contained ONNX files that check-onnx accepts, served by onnxruntime."""
    spec = '{"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2}'
    out = tmp_path / "edge"
    r = run_cli("compile", "--model", str(tiny_dir), "--backend", "onnx", "--self-contained", "--out", str(out),
                "--buckets", "1", "--max-context", "64", "--variants", "greedy,filtered", "--prefill-chunk", "16",
                "--speculative-config", spec)
    assert r.returncode == 0, r.stderr
    files = sorted(str(p) for p in out.glob("*.onnx"))
    # prefill, decode x2, verify x2 (greedy, exact), draft prefill and sync, draft x2 (plain, filtered); weights
    # inside each file
    assert len(files) == 9 and not list(out.glob("*.bin"))
    check = run_cli("check-onnx", *files)
    assert check.returncode == 0, check.stdout + check.stderr
    ids = json.dumps(list(range(5, 25)))
    common = ["--model", str(tiny_dir), "--prompt-ids", ids, "--max-tokens", "12", "--json", "--temperature", "0.8",
              "--top-k", "20", "--seed", "3", "--ignore-eos"]
    onnx_run = run_cli("generate", *common, "--artifacts", str(out))
    eager_run = run_cli("generate", "--backend", "eager", *common, "--max-context", "64", "--speculative-config", spec)
    assert onnx_run.returncode == 0 and eager_run.returncode == 0, onnx_run.stderr + eager_run.stderr
    assert json.loads(onnx_run.stdout)["token_ids"] == json.loads(eager_run.stdout)["token_ids"]
    bad = run_cli("check-onnx", str(out / "manifest.json"))
    assert bad.returncode != 0
