"""Tensor parallelism over 2 real processes (gloo): the same tokens as one process for every proposer, with
speculation on, off (disable_by_batch_size) and beside chunked prefills; seeded sampling too; both ranks call
the same graphs in the protocol's order; a worker that dies or hangs ends the driver with an error naming it."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import save_tiny
from test_engine import random_heads

from specair.models import shm_collectives
from specair.models.checkpoint import load_checkpoint
from specair.models.eagle import save_eagle
from specair.models.errors import InputError, ModelFormatError
from specair.models.llama import TensorParallel, build_model, shard_layout, shard_slice, shard_state_dict
from specair.models.medusa import save_medusa
from specair.runtime.llm import LLM
from specair.runtime.params import SamplingParams
from specair.runtime.tensor_parallel import TensorParallelError

# Prompts of 5 to 150 tokens: the longest prefills in two chunks while the others decode.
PROMPTS = [[3, 7, 11, 3, 7, 11, 3, 7], list(range(20, 170)), [9, 8, 7, 6, 5], list(range(60, 100, 2)) * 2]
# float64: the ranks sum partial products in another order than one process, so in float32 a sample whose
# uniform or nucleus boundary sits within rounding of a probability boundary can differ (seen at top-p 0.9).
KW = dict(max_context=256, batch_buckets=(1, 2, 4), dtype="fp64")
CASES = {
    "autoregressive": None,
    # disable_by_batch_size 1: a step speculates only while one row runs, so runs mix both kinds of step.
    "draft_model": {"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 3, "tree": "kary:3x2"},
    "layer_skip": {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3},
    "eagle": {"method": "eagle", "model": "HEADS", "num_speculative_tokens": 3, "tree": "topk:2x5"},
    "medusa": {"method": "medusa", "model": "HEADS", "num_speculative_tokens": 2, "tree": [[0], [1], [0, 0], [0, 1]]},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    save_tiny("llama-tied", root / "target", num_hidden_layers=3, max_position_embeddings=512)
    save_tiny("llama", root / "draft", seed=1, num_hidden_layers=1, max_position_embeddings=512)
    ckpt = load_checkpoint(root / "target", progress=False)
    target = build_model(ckpt.config, ckpt.state_dict)
    save_eagle(random_heads(target, CASES["eagle"]), root / "eagle")
    save_medusa(random_heads(target, CASES["medusa"]), root / "medusa")
    return root


def spec_for(name, root):
    spec = CASES[name]
    if spec is None:
        return None
    path = {"draft_model": root / "draft", "eagle": root / "eagle", "medusa": root / "medusa"}.get(name)
    return {**spec, **({"model": str(path)} if path else {}), "disable_by_batch_size": 1}


def trace(directory, rank):
    steps = []
    for line in (directory / f"rank{rank}.jsonl").read_text().splitlines():
        item = json.loads(line)
        if "step" in item:
            steps.append((item["step"], []))
        else:
            steps[-1][1].append(item["graph"].split(".")[0])
    return steps


def check_order(steps, speculative):
    """The protocol's order: a speculative step runs the draft, then the target's verify; a plain step the
    target's decode (the draft catches up before its next proposal); a prefill chunk the target, then the
    draft's own prefill."""
    target = {"prefill", "decode", "verify"}
    kinds = set()
    for meta, calls in steps:
        cut = calls.index("prefill") if "prefill" in calls else len(calls)
        decode, prefill = calls[:cut], calls[cut:]
        if meta["rows"]:
            if meta["no_spec"]:
                assert decode == ["decode"], (meta, calls)
            else:
                assert decode[-1] == "verify" and not target & set(decode[:-1]), (meta, calls)
        kinds.add((meta["no_spec"], meta["prefill"]))
        assert bool(prefill) == meta["prefill"], (meta, calls)
        if prefill:
            assert not target & set(prefill[1:]), (meta, calls)
            assert meta["run_spec_proposer_for_prefill"] == speculative
    if speculative:  # the prompts make every combination happen
        assert {(True, True), (True, False), (False, True), (False, False)} <= kinds, kinds


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_process(models, name, tmp_path, monkeypatch):
    spec = spec_for(name, models)
    # Budgets that end apart: the last request decodes alone (speculating) after the others finish.
    greedy = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 24, 16, 64)]
    seeded = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, top_p=0.9, seed=s) for s in range(4)]
    with LLM(str(models / "target"), spec, **KW) as one:
        want = [[r.token_ids for r in one.generate(PROMPTS, p)] for p in (greedy, seeded)]
    monkeypatch.setenv("SPECAIR_TP_TRACE", str(tmp_path))
    with LLM(str(models / "target"), spec, tensor_parallel_size=2, **KW) as two:
        assert two.engine.group.world == 2
        got = [[r.token_ids for r in two.generate(PROMPTS, p)] for p in (greedy, seeded)]
    assert got[0] == want[0]
    assert got[1] == want[1]
    rank0, rank1 = trace(tmp_path, 0), trace(tmp_path, 1)
    assert rank0 == rank1  # the same decisions and the same graphs, in the same order, on both ranks
    check_order(rank0, spec is not None)


def test_collectives_run_in_shared_memory_by_default_and_on_gloo_when_asked(models, monkeypatch):
    """CPU ranks on one x86-64 host all-reduce through shared memory; $SPECAIR_TP_COLLECTIVES=gloo keeps the
    process group's collectives. Both give one process's greedy tokens."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with LLM(str(models / "target"), **KW) as one:
        want = [r.token_ids for r in one.generate(PROMPTS, params)]
    for kind in ("shm", "gloo"):
        monkeypatch.setenv("SPECAIR_TP_COLLECTIVES", kind)
        with LLM(str(models / "target"), tensor_parallel_size=2, **KW) as two:
            assert (two.engine.group.tp.shm is not None) == (kind == "shm" and shm_collectives.supported())
            assert [r.token_ids for r in two.generate(PROMPTS, params)] == want, kind


def _shm_rank(rank, world, init, path, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    shm = shm_collectives.ShmGroup(path, rank, world, dist.group.WORLD, timeout=3, slot_bytes=4096)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64)
    big = torch.randn(1000, generator=g)  # 4000 bytes fit a slot; 1000 float64 do not: gloo's all-reduce
    results = {"sum": shm.all_reduce(x), "gather": shm.all_gather(x[:2]), "big": shm.all_reduce(big.double()),
               "again": torch.ops.specair.shm_all_reduce(x, shm.id), "x": x, "bigx": big.double()}
    dist.barrier()
    if rank == 1:
        out[rank] = results
        dist.destroy_process_group()
        return  # does not come to the next collective
    try:
        shm.all_reduce(x)
    except RuntimeError as e:
        results["late"] = str(e)
    out[rank] = results


@pytest.mark.skipif(not shm_collectives.supported(), reason="shared-memory collectives need an x86-64 host")
def test_shared_memory_collectives_between_two_processes(tmp_path):
    """Both ranks get the same sum, bit for bit, equal to x0 + x1; the gather is in rank order; a collective
    larger than a slot goes through gloo; a rank that never arrives fails the call naming it."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_shm_rank, args=(r, 2, f"file://{tmp_path}/store", str(tmp_path / "shm"), out))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        r0, r1 = dict(out[0]), dict(out[1])
    assert all(p.exitcode == 0 for p in procs)
    assert torch.equal(r0["sum"], r0["x"] + r1["x"]) and torch.equal(r1["sum"], r0["sum"])
    assert torch.equal(r0["again"], r0["sum"])
    assert torch.equal(r0["gather"], torch.cat([r0["x"][:2], r1["x"][:2]])) and torch.equal(r1["gather"], r0["gather"])
    assert torch.allclose(r0["big"], r0["bigx"] + r1["bigx"]) and torch.equal(r1["big"], r0["big"])
    assert "rank(s) [1] did not reach" in r0["late"]


def test_torchrun_starts_the_ranks_of_one_command(models):
    """Under torchrun every process runs the same `specair generate`: rank 0 drives and prints, rank 1 follows
    and exits with it, and the tokens are one process's."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLM(str(models / "target"), **KW) as one:
        want = one.generate([PROMPTS[1]], params)[0].token_ids
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "specair.runtime.cli", "generate", "--model", str(models / "target"), "--tensor-parallel-size", "2",
           "--backend", "eager", "--dtype", "fp64", "--max-context", "256", "--prompt-ids", json.dumps(PROMPTS[1]),
           "--max-tokens", "12", "--ignore-eos", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    printed = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 1 and printed[0]["token_ids"] == want  # rank 0 alone prints


def test_dead_worker_ends_the_driver_naming_it(models):
    llm = LLM(str(models / "target"), tensor_parallel_size=2, **KW)
    worker = llm.engine.group.procs[1]
    events = llm.stream(PROMPTS[0], SamplingParams(max_tokens=240, ignore_eos=True))
    next(events)  # under way
    worker.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with signal SIGKILL"):
        for _ in events:
            pass
    assert time.monotonic() - killed < 30
    with pytest.raises(TensorParallelError, match="rank 1"):  # the group is over, and says why
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4))
    llm.close()


def test_hung_worker_times_out_naming_it(models, monkeypatch):
    monkeypatch.setenv("SPECAIR_TP_TIMEOUT", "6")
    llm = LLM(str(models / "target"), tensor_parallel_size=2, **KW)
    worker = llm.engine.group.procs[1]
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4))
    worker.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 .*stopped responding"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=50, ignore_eos=True))
    assert time.monotonic() - t0 < 30
    assert worker.poll() is not None  # ended with the group, though stopped
    llm.close()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_each_rank_reads_only_its_part_of_the_checkpoint(tmp_path, kind, world):
    """9 query heads in 3 KV groups, FFN 100 and a vocabulary of 257 over 2 and 3 ranks (unequal shares, a
    padded last vocabulary shard; qwen2: QKV biases, tied head; llama: its own LM head): each rank reads
    its slice of every tensor, the same as cutting the whole checkpoint, and the ranks' parts put back
    together are the whole; a rank's model holds just them."""
    save_tiny(kind, tmp_path, hidden_size=72, num_attention_heads=9, num_key_value_heads=3, head_dim=8,
              intermediate_size=100, vocab_size=257)
    whole = load_checkpoint(tmp_path, progress=False)
    cfg, full = whole.config, whole.state_dict
    parts = [load_checkpoint(tmp_path, progress=False, shard=(r, world)) for r in range(world)]
    for r, part in enumerate(parts):
        assert part.shard == (r, world) and part.state_dict.keys() == full.keys()
        cut = shard_state_dict(full, cfg, r, world)
        assert all(torch.equal(part.state_dict[k], cut[k]) for k in full)
    for name, t in full.items():
        pieces = [p.state_dict[name] for p in parts]
        if shard_slice(shard_layout(cfg, 0, world), name, cfg) is None:
            assert all(torch.equal(p, t) for p in pieces), name
        else:
            dim = shard_slice(shard_layout(cfg, 0, world), name, cfg)[0]
            assert torch.equal(torch.cat(pieces, dim), t), name
    norms = sum(t.numel() for k, t in full.items() if k.endswith("norm.weight"))
    read = sum(t.numel() for p in parts for t in p.state_dict.values())
    assert read == sum(t.numel() for t in full.values()) + (world - 1) * norms

    heads = [shard_layout(cfg, r, world).config for r in range(world)]
    assert [c.num_kv_heads for c in heads] == [3 // world + (r < 3 % world) for r in range(world)]
    assert sum(c.num_heads for c in heads) == 9 and sum(c.intermediate_size for c in heads) == 100
    model = build_model(cfg, parts[-1].state_dict, tp=TensorParallel(None, world - 1, world))
    per = -(-257 // world)
    assert model.config == heads[-1] and model.config.vocab_size == 257
    assert model.tok_embeddings.weight.shape == (per, 72) and model.tok_embeddings.vocab_start == (world - 1) * per
    assert torch.equal(model.tok_embeddings.weight[:257 - (world - 1) * per], full["model.embed_tokens.weight"][-(257 - (world - 1) * per):])
    assert not model.tok_embeddings.weight[257 - (world - 1) * per:].any()
    a = model.layers[0].attention
    assert a.wqkv.weight.shape[0] == (heads[-1].num_heads + 2 * heads[-1].num_kv_heads) * 8 and a.tp.world == world
    assert (a.wqkv.bias is not None) == (kind == "qwen2")


def test_bad_setups_are_refused(models):
    with pytest.raises(InputError, match="onnx backend cannot run tensor-parallel"):
        LLM(str(models / "target"), backend="onnx", tensor_parallel_size=2, **KW)
    with pytest.raises(ModelFormatError, match="needs at least 3 KV heads"):
        LLM(str(models / "target"), tensor_parallel_size=3, **KW)
    with pytest.raises(InputError, match="--artifacts cannot be combined"):
        LLM(str(models / "target"), artifacts=str(models), tensor_parallel_size=2, **KW)


def _children(pid):
    try:
        return [int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in open(f"/proc/{pid}/task/{t}/children").read().split()]
    except OSError:
        return []


def test_server_answers_503_and_exits_when_a_worker_dies(models, tmp_path):
    import httpx

    port = 18000 + os.getpid() % 1000
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "specair.runtime.server", "--model", str(models / "target"),
                               "--tensor-parallel-size", "2", "--backend", "eager", "--port", str(port), "--max-context", "256",
                               "--batch-buckets", "1,2"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            time.sleep(0.2)
        body = {"model": "target", "prompt": [1, 2, 3], "max_tokens": 8}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        workers = [c for c in _children(server.pid) if "tensor_parallel" in open(f"/proc/{c}/cmdline").read()]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        statuses = set()
        while server.poll() is None and time.monotonic() - t0 < 30:
            try:
                statuses.add(httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code)
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        assert server.wait(30) != 0
        assert 503 in statuses, statuses
        assert time.monotonic() - t0 < 30
        assert not os.path.exists(f"/proc/{workers[0]}") or "Z" in open(f"/proc/{workers[0]}/stat").read().split()[2]
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
