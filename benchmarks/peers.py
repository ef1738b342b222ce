"""Peers for `specair bench` on the same weights: HF transformers `generate()` (greedy, prompt lookup,
assisted by a draft model), llama.cpp through llama-cpp-python (plain and with its prompt-lookup
draft) and OpenVINO GenAI's `LLMPipeline` over an optimum-intel int4 export (plain and prompt lookup). Each runs the same token ids as specair; the harness times them the same way: time to the
first generated token and to the last, from the tokens each engine streams out.

Peers are optional (the `peers` extra): a missing one raises PeerUnavailable, which the harness turns
into a note, never a number.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from specair.benchmarks.report import Sample
from specair.models.errors import SpecairError
from specair.runtime.params import SamplingParams

TRANSFORMERS_PEERS = ("hf", "hf-prompt-lookup", "hf-assisted")
LLAMACPP_PEERS = ("llama.cpp", "llama.cpp-prompt-lookup")
OPENVINO_PEERS = ("openvino", "openvino-prompt-lookup")
PEERS = TRANSFORMERS_PEERS + LLAMACPP_PEERS + OPENVINO_PEERS
OPENVINO_EXPORT = ("--task", "text-generation-with-past", "--weight-format", "int4", "--group-size", "32",
                   "--ratio", "1.0")  # optimum-cli export openvino: every linear layer int4 asymmetric, blocks of 32


class PeerUnavailable(SpecairError):
    """A peer cannot run here (package not installed, no weights in its format, no assistant model)."""


def peer_baseline(peer: str) -> str:
    """The entry a peer's speedup is measured against: its own engine's plain decoding."""
    return "hf" if peer in TRANSFORMERS_PEERS else "llama.cpp" if peer in LLAMACPP_PEERS else "openvino"


def peer_engine(peer: str) -> str:
    """The engine a peer runs on, as the report names it."""
    return {"hf": "transformers", "llama.cpp": "llama.cpp", "openvino": "OpenVINO GenAI"}[peer_baseline(peer)]


class _StepClock:
    """A transformers streamer that timestamps the first generated token and the last, and counts the
    target passes: generate() puts the prompt once, then each forward pass's accepted tokens once."""

    def __init__(self) -> None:
        self.puts = 0
        self.t_first: float | None = None
        self.t_last: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 1:  # the prompt
            return
        now = time.perf_counter()
        self.t_first = self.t_first or now
        self.t_last = now

    def end(self) -> None:
        pass


class TransformersPeer:
    """HF transformers generate() on an HF checkpoint dir, batch 1 (and plain greedy batches, left-padded)."""

    def __init__(self, peer: str, hf_dir: str, *, assistant: str | None = None, prompt_lookup_tokens: int = 10,
                 prompt_lookup_max_ngram: int = 2, threads: int | None = None) -> None:
        if importlib.util.find_spec("transformers") is None:
            raise PeerUnavailable("transformers is not installed (pip install 'specair[peers]')")
        if peer == "hf-assisted" and not assistant:
            raise PeerUnavailable("hf-assisted needs an assistant model (--assistant HF_DIR)")
        import torch
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.peer, self.torch = peer, torch
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        self.assistant = (AutoModelForCausalLM.from_pretrained(assistant, dtype=torch.float32).eval()
                          if peer == "hf-assisted" else None)
        self.prompt_lookup_tokens, self.max_ngram = prompt_lookup_tokens, prompt_lookup_max_ngram
        cfg_eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(cfg_eos if isinstance(cfg_eos, list) else [] if cfg_eos is None else [cfg_eos])
        self.pad_id = min(self.eos_ids) if self.eos_ids else 0

    def _kwargs(self, params: SamplingParams) -> dict[str, Any]:
        kw: dict[str, Any] = {"max_new_tokens": params.max_tokens, "pad_token_id": self.pad_id}
        if params.temperature == 0:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kw.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
        if params.ignore_eos:  # EOS may be generated but does not stop (min_new_tokens would forbid it instead)
            kw["eos_token_id"] = None
        if self.peer == "hf-prompt-lookup":
            kw.update(prompt_lookup_num_tokens=self.prompt_lookup_tokens, max_matching_ngram_size=self.max_ngram)
        elif self.peer == "hf-assisted":
            kw["assistant_model"] = self.assistant
        return kw

    def _trim(self, ids: list[int], params: SamplingParams) -> list[int]:
        if not params.ignore_eos:
            for i, t in enumerate(ids):
                if t in self.eos_ids:
                    return ids[:i + 1]
        return ids

    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams, rnd: int,
            indices: Sequence[int]) -> tuple[list[Sample], float]:
        """Generate for the prompts (one request, or a left-padded greedy batch); samples and wall time."""
        torch = self.torch
        if params.seed is not None:
            torch.manual_seed(params.seed)
        if len(prompts) == 1:
            clock = _StepClock()
            x = torch.tensor([list(prompts[0])])
            with torch.no_grad():
                t0 = time.perf_counter()
                out = self.model.generate(x, attention_mask=torch.ones_like(x), streamer=clock, **self._kwargs(params))
                t_end = time.perf_counter()
            ids = self._trim(out[0, x.shape[1]:].tolist(), params)
            t_first = (clock.t_first or t_end) - t0
            return [Sample(indices[0], rnd, ids, t_first, (clock.t_last or t_end) - t0,
                           target_passes=max(clock.puts - 2, 0))], t_end - t0
        if self.peer != "hf":
            raise PeerUnavailable(f"{self.peer}: transformers' assisted generation runs batch 1 only")
        width = max(map(len, prompts))
        x = torch.full((len(prompts), width), self.pad_id)
        mask = torch.zeros_like(x)
        for i, p in enumerate(prompts):
            x[i, width - len(p):] = torch.tensor(list(p))
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            t0 = time.perf_counter()
            out = self.model.generate(x, attention_mask=mask, **self._kwargs(params))
            wall = time.perf_counter() - t0
        samples = [Sample(j, rnd, self._trim(out[i, width:].tolist(), params), float("nan"), float("nan"))
                   for i, j in enumerate(indices)]
        return samples, wall


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python on a GGUF file, batch 1, with or without prompt lookup."""

    def __init__(self, peer: str, gguf: str, *, max_context: int = 2048, prompt_lookup_tokens: int = 10,
                 prompt_lookup_max_ngram: int = 2, threads: int | None = None, seed: int | None = None) -> None:
        if importlib.util.find_spec("llama_cpp") is None:
            raise PeerUnavailable("llama-cpp-python is not installed (pip install llama-cpp-python; it compiles "
                                  "llama.cpp)")
        if not Path(gguf).is_file():
            raise PeerUnavailable(f"no GGUF file at {gguf}")
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = (LlamaPromptLookupDecoding(max_ngram_size=prompt_lookup_max_ngram,
                                           num_pred_tokens=prompt_lookup_tokens)
                 if peer == "llama.cpp-prompt-lookup" else None)
        kw: dict[str, Any] = {"n_ctx": max_context, "verbose": False, "draft_model": draft}
        if threads:
            kw.update(n_threads=threads, n_threads_batch=threads)
        if seed is not None:
            kw["seed"] = seed
        self.llm = Llama(model_path=str(gguf), **kw)
        self.eos_ids = {self.llm.token_eos()}
        self.passes = 0
        evaluate = self.llm.eval

        def counted_eval(tokens: Sequence[int]) -> None:  # one call per target pass (the prompt's included)
            self.passes += 1
            evaluate(tokens)

        self.llm.eval = counted_eval

    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams, rnd: int,
            indices: Sequence[int]) -> tuple[list[Sample], float]:
        if len(prompts) != 1:
            raise PeerUnavailable("llama-cpp-python's Llama runs one sequence at a time")
        if params.seed is not None:
            self.llm.set_seed(params.seed)
        # No prefix reuse between requests: specair has no prefix cache, so every engine prefills in full.
        self.llm.reset()
        self.passes = 0
        sampling = ({"temp": 0.0} if params.temperature == 0 else
                    {"temp": params.temperature, "top_p": params.top_p, "top_k": params.top_k})
        out: list[int] = []
        t0 = time.perf_counter()
        t_first = None
        gen = self.llm.generate(list(prompts[0]), min_p=0.0, typical_p=1.0, repeat_penalty=1.0,
                                **{"top_k": 0, "top_p": 1.0, **sampling})
        for tok in gen:
            t_first = t_first or time.perf_counter()
            out.append(tok)
            if tok in self.eos_ids and not params.ignore_eos or len(out) >= params.max_tokens:
                break
        gen.close()
        t_end = time.perf_counter()
        return [Sample(indices[0], rnd, out, (t_first or t_end) - t0, t_end - t0,
                       target_passes=max(self.passes - 1, 0))], t_end - t0


def openvino_export(hf_dir: str, cache_root: Path) -> Path:
    """The optimum-intel int4 export of an HF checkpoint dir for OpenVINO GenAI, made once into the cache
    (keyed by the checkpoint's config and weights files' sizes and times) and reused afterwards."""
    import hashlib
    import shutil
    import subprocess
    import sys

    if shutil.which("optimum-cli") is None and importlib.util.find_spec("optimum.intel") is None:
        raise PeerUnavailable("the OpenVINO GenAI peer exports the model with optimum-intel, which is not installed "
                              "(pip install 'specair[peers]')")
    src = Path(hf_dir)
    stamp = hashlib.sha256(repr(sorted((f.name, f.stat().st_size, int(f.stat().st_mtime))
                                       for f in src.iterdir() if f.is_file())).encode()).hexdigest()[:16]
    out = cache_root / "peers" / f"openvino-int4-g32-{stamp}"
    if (out / "openvino_model.xml").is_file() and (out / "openvino_tokenizer.xml").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"bench: exporting {src} for OpenVINO GenAI (optimum-cli export openvino {' '.join(OPENVINO_EXPORT)}), "
          "once", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(src),
           *OPENVINO_EXPORT, str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not (tmp / "openvino_model.xml").is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise PeerUnavailable(f"optimum-cli export openvino failed: {' / '.join(tail)}")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


class OpenVinoGenAIPeer:
    """OpenVINO GenAI's LLMPipeline on CPU over the int4 export, batch 1, plain or with prompt lookup."""

    def __init__(self, peer: str, hf_dir: str, cache_root: Path, *, prompt_lookup_tokens: int = 10,
                 prompt_lookup_max_ngram: int = 2, threads: int | None = None) -> None:
        if importlib.util.find_spec("openvino_genai") is None:
            raise PeerUnavailable("openvino-genai is not installed (pip install 'specair[peers]')")
        import openvino_genai as og

        self.og, self.peer = og, peer
        self.path = openvino_export(hf_dir, cache_root)
        props: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads} if threads else {}
        if peer == "openvino-prompt-lookup":
            props["prompt_lookup"] = True
        self.pipe = og.LLMPipeline(str(self.path), "CPU", **props)
        self.prompt_lookup_tokens, self.max_ngram = prompt_lookup_tokens, prompt_lookup_max_ngram
        self.eos_ids = set(self.pipe.get_generation_config().stop_token_ids) or {
            self.pipe.get_tokenizer().get_eos_token_id()}

    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams, rnd: int,
            indices: Sequence[int]) -> tuple[list[Sample], float]:
        if len(prompts) != 1:
            raise PeerUnavailable("the OpenVINO GenAI peer runs one sequence at a time")
        import numpy as np
        import openvino as ov

        og = self.og
        cfg = self.pipe.get_generation_config()
        cfg.max_new_tokens = params.max_tokens
        cfg.ignore_eos = params.ignore_eos
        cfg.repetition_penalty = 1.0
        if params.temperature == 0:
            cfg.do_sample = False
        else:
            cfg.do_sample, cfg.temperature, cfg.top_p = True, params.temperature, params.top_p
            cfg.top_k = params.top_k or 0
            if params.seed is not None:
                cfg.rng_seed = params.seed
        if self.peer == "openvino-prompt-lookup":
            cfg.num_assistant_tokens, cfg.max_ngram_size = self.prompt_lookup_tokens, self.max_ngram
        out: list[int] = []
        stamps: list[float] = []

        class Clock(og.StreamerBase):  # one write per target pass (a list when prompt lookup accepts several)
            def write(self, token):  # noqa: ANN001 (pybind passes int or list[int])
                stamps.append(time.perf_counter())
                out.extend(token if isinstance(token, list) else [token])
                return og.StreamingStatus.RUNNING

            def end(self) -> None:
                pass

        ids = ov.Tensor(np.asarray([list(prompts[0])], dtype=np.int64))
        t0 = time.perf_counter()
        self.pipe.generate(ids, cfg, Clock())
        t_end = time.perf_counter()
        if not params.ignore_eos:
            for i, t in enumerate(out):
                if t in self.eos_ids:
                    out = out[:i + 1]
                    break
        t_first = (stamps[0] if stamps else t_end) - t0
        return [Sample(indices[0], rnd, out[:params.max_tokens], t_first, (stamps[-1] if stamps else t_end) - t0,
                       target_passes=max(len(stamps) - 1, 0))], t_end - t0
