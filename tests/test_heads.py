"""Draft heads: EAGLE-1/2, Medusa-1 and MLPSpeculator.

Loaders read hand-built checkpoints in the upstream layouts (SafeAILab, FasterDecoding, IBM/vLLM) and
refuse wrong shapes and pickles; save -> load round-trips bit-identically; the EAGLE head equals a
reference built from transformers' LlamaDecoderLayer; the draft loops with an EAGLE head equal a
brute-force reference that recomputes every node's path from scratch; the head graphs equal
step-by-step references and compile with fullgraph=True.
"""

import json
import math

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
import transformers
from helpers import save_tiny
from safetensors.torch import save_file
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from specair.graphs.draft import draft_chain, draft_static_tree, draft_topk_tree
from specair.graphs.heads import medusa_tree, mlp_speculator_chain
from specair.graphs.tree import MC_SIM_7B_63, from_choices, get_template
from specair.models.checkpoint import load_checkpoint
from specair.models.eagle import EagleHead, load_eagle, save_eagle
from specair.models.eagle3 import Eagle3Head, load_eagle3, save_eagle3
from specair.models.errors import ModelFormatError
from specair.models.llama import build_model
from specair.models.medusa import MedusaHeads, load_medusa, save_medusa
from specair.models.mlp_speculator import MLPSpeculator, load_mlp_speculator, save_mlp_speculator

H, V, HEADS, KV_HEADS, D = 64, 256, 4, 2, 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny("llama", path)
    return load_checkpoint(path, progress=False)


@pytest.fixture(scope="module")
def target(ckpt):
    return build_model(ckpt.config, ckpt.state_dict)


@pytest.fixture(scope="module")
def target64(ckpt):
    return build_model(ckpt.config, ckpt.state_dict, torch.float64)


def randomise(head, seed=0):
    """Random weights in an EAGLE head's own layers (norms and biases too, so a dropped one shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*head.fc.named_parameters(), *head.layers.named_parameters()]:
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.2
            p.copy_((noise + 1 if name.endswith("norm.weight") else noise).to(p.dtype))
    return head


def safeailab_state(seed=0, inter=96, hidden=H, fc_bias=True):
    """A SafeAILab-layout EAGLE state dict (as cnets.Model.state_dict() holds it, embed_tokens included)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    p = "layers.0."
    sd = {"fc.weight": r(hidden, 2 * hidden), "embed_tokens.weight": r(V, hidden),
          p + "self_attn.q_proj.weight": r(HEADS * D, hidden), p + "self_attn.k_proj.weight": r(KV_HEADS * D, hidden),
          p + "self_attn.v_proj.weight": r(KV_HEADS * D, hidden), p + "self_attn.o_proj.weight": r(hidden, HEADS * D),
          p + "mlp.gate_proj.weight": r(inter, hidden), p + "mlp.up_proj.weight": r(inter, hidden),
          p + "mlp.down_proj.weight": r(hidden, inter), p + "post_attention_layernorm.weight": 1 + r(hidden)}
    if fc_bias:
        sd["fc.bias"] = r(hidden)
    return sd


# ---- EAGLE ----

def test_eagle_loads_safeailab_layout_and_matches_transformers_layer(tmp_path, ckpt, target):
    sd = safeailab_state()
    save_file(sd, str(tmp_path / "model.safetensors"))
    cfg = {**ckpt.config.to_hf(), "num_hidden_layers": 1, "intermediate_size": 96, "bias": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    head = load_eagle(tmp_path, target)
    assert head.config.intermediate_size == 96 and head.config.num_layers == 1
    assert head.tok_embeddings is target.tok_embeddings  # shared, not copied

    # Reference: transformers' decoder layer with the input norm skipped, fed fc(cat(embedding, hidden)).
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("bias", "architectures")})
    hf_cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(hf_cfg, layer_idx=0).eval()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in sd.items() if k.startswith("layers.0.")},
                          strict=False)
    layer.input_layernorm = torch.nn.Identity()
    rotary = LlamaRotaryEmbedding(hf_cfg)
    B, T = 2, 7
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (B, T), generator=g)
    feats = torch.randn(B, T, H, generator=g)
    pos = torch.arange(T).expand(B, T)
    with torch.no_grad():
        x = F.linear(torch.cat([target.tok_embeddings(tokens), feats], -1), sd["fc.weight"], sd["fc.bias"])
        causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, T, T)
        out = layer(x, attention_mask=causal, position_ids=pos, position_embeddings=rotary(x, pos))
        ref_hidden = out[0] if isinstance(out, tuple) else out
        ref_logits = ref_hidden @ target.tok_embeddings.weight.t() if target.output is None else \
            ref_hidden @ target.output.weight.t()
        k, v = head.empty_cache(B, 16)
        got = head(tokens, pos, torch.zeros(B, dtype=torch.long), k, v, input_hidden=feats)
    assert got.new_k.shape == (1, B, KV_HEADS, T, D)
    assert torch.allclose(got.hidden, ref_hidden, atol=1e-5)
    assert torch.allclose(got.logits, ref_logits, atol=1e-5)

    # The same sequence in two pieces through the cache: the second piece reads the first's committed K/V.
    with torch.no_grad():
        first = head(tokens[:, :4], pos[:, :4], torch.zeros(B, dtype=torch.long), k, v, input_hidden=feats[:, :4])
        k[:, :, :, :4], v[:, :, :, :4] = first.new_k, first.new_v
        second = head(tokens[:, 4:], pos[:, 4:], torch.full((B,), 4), k, v, input_hidden=feats[:, 4:],
                      logits_index=torch.tensor([[2], [0]]))
    assert torch.allclose(second.hidden, ref_hidden[:, 4:], atol=1e-5)
    assert torch.allclose(second.logits[:, 0], ref_logits[[0, 1], [6, 4]], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_eagle_save_load_round_trip(tmp_path, ckpt, dtype):
    target = build_model(ckpt.config, ckpt.state_dict, dtype)
    head = randomise(EagleHead(target, draft_vocab=torch.arange(3, V, 5)))
    save_eagle(head, tmp_path)
    keys = set(json.loads((tmp_path / "config.json").read_text()))
    assert {"hidden_size", "num_attention_heads", "bias"} <= keys
    loaded = load_eagle(tmp_path / "model.safetensors", target)
    a, b = head.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    tokens, pos = torch.tensor([[5, 9, 200]]), torch.arange(3)[None]
    feats = torch.randn(1, 3, H).to(dtype)
    k, v = head.empty_cache(1, 8)
    with torch.no_grad():
        x = head(tokens, pos, torch.zeros(1, dtype=torch.long), k, v, input_hidden=feats)
        y = loaded(tokens, pos, torch.zeros(1, dtype=torch.long), k, v, input_hidden=feats)
    assert torch.equal(x.logits, y.logits) and torch.equal(x.hidden, y.hidden)


def test_eagle_draft_vocab_restricts_logits(target):
    ids = torch.tensor([7, 3, 250, 100])
    full, small = randomise(EagleHead(target)), randomise(EagleHead(target, draft_vocab=ids))
    feats = torch.randn(1, 2, H)
    k, v = full.empty_cache(1, 4)
    args = (torch.tensor([[1, 2]]), torch.arange(2)[None], torch.zeros(1, dtype=torch.long), k, v)
    with torch.no_grad():
        a, b = full(*args, input_hidden=feats), small(*args, input_hidden=feats)
    assert torch.allclose(b.logits[..., ids], a.logits[..., ids], atol=1e-6)
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    assert (b.logits[..., outside] == torch.finfo(torch.float32).min).all()
    assert set(b.logits.argmax(-1).flatten().tolist()) <= set(ids.tolist())
    assert torch.equal(small.logits(b.hidden, reduced=True), b.logits[..., ids])


def test_eagle_loader_refuses_bad_checkpoints(tmp_path, target):
    def attempt(name, sd, config=None, file="model.safetensors"):
        d = tmp_path / name
        d.mkdir()
        save_file(sd, str(d / file))
        if config is not None:
            (d / "config.json").write_text(json.dumps(config))
        with pytest.raises(ModelFormatError) as e:
            load_eagle(d, target)
        return str(e.value)

    assert "hidden size" in attempt("wide", safeailab_state(hidden=96))
    assert "EAGLE-3" in attempt("e3", {"midlayer.hidden_norm.weight": torch.ones(H), "d2t": torch.zeros(4)})
    bad = safeailab_state()
    bad["layers.0.self_attn.k_proj.weight"] = torch.zeros(20, H)
    assert "head_dim" in attempt("kv", bad)
    assert "num_attention_heads" in attempt("cfg", safeailab_state(), {"num_attention_heads": 8, "hidden_size": H})
    short = safeailab_state()
    del short["layers.0.mlp.down_proj.weight"]
    assert "mlp.down_proj.weight" in attempt("missing", short)
    assert "input_layernorm" in attempt("norm", {**safeailab_state(), "layers.0.input_layernorm.weight": torch.ones(H)})
    d = tmp_path / "pickled"
    d.mkdir()
    torch.save(safeailab_state(), d / "pytorch_model.bin")
    with pytest.raises(ModelFormatError, match="pickle.*safetensors"):
        load_eagle(d, target)
    with pytest.raises(ModelFormatError, match="pickle"):
        load_eagle(d / "pytorch_model.bin", target)


# ---- EAGLE draft loops against a brute-force reference ----

B, W, SLOTS, CTX = 2, 4, 48, 32


def eagle_setup(target64, seed=0):
    """A float64 head, per-row committed history (token, hidden) in its cache, and a catch-up chunk."""
    head = randomise(EagleHead(target64), seed)
    g = torch.Generator().manual_seed(seed + 1)
    draft_len, n_catch = torch.tensor([5, 11]), torch.tensor([2, 4])
    hist_tok = torch.randint(0, V, (B, 16), generator=g)
    hist_hid = torch.randn(B, 16, H, generator=g, dtype=torch.float64)
    catch_tok = torch.randint(0, V, (B, W), generator=g)
    catch_hid = torch.randn(B, W, H, generator=g, dtype=torch.float64)
    k, v = head.empty_cache(B, SLOTS)
    k.normal_(generator=g)  # garbage beyond each row's length must stay invisible
    v.normal_(generator=g)
    with torch.no_grad():
        for b in range(B):
            n = int(draft_len[b])
            kb, vb = head.empty_cache(1, 8)
            out = head(hist_tok[b:b + 1, :n], torch.arange(n)[None], torch.zeros(1, dtype=torch.long), kb, vb,
                       input_hidden=hist_hid[b:b + 1, :n])
            k[:, b, :, :n], v[:, b, :, :n] = out.new_k[:, 0], out.new_v[:, 0]
    rows = []
    for b in range(B):
        n, c = int(draft_len[b]), int(n_catch[b])
        rows.append((torch.cat([hist_tok[b, :n], catch_tok[b, :c]]), torch.cat([hist_hid[b, :n], catch_hid[b, :c]])))
    return head, (catch_tok, n_catch, draft_len, k, v), catch_hid, rows


class BruteForce:
    """Every node's logits and output feature from one uncached pass over its whole path: the committed and
    catch-up entries, then the drafted tokens, each drafted token paired with its parent's output feature."""

    def __init__(self, head, tokens, hiddens):
        self.head, self.tokens, self.hiddens, self.memo = head, tokens, hiddens, {}

    def __call__(self, path):  # path: drafted tokens below the root -> (logits [V], feature [H])
        path = tuple(path)
        if path not in self.memo:
            feats = [self.hiddens]
            if path:
                feats += [torch.stack([self(path[:i])[1] for i in range(len(path))])]
            toks = torch.cat([self.tokens, torch.tensor(path, dtype=torch.long)])
            n = toks.shape[0]
            k, v = self.head.empty_cache(1, 1)
            with torch.no_grad():
                out = self.head(toks[None], torch.arange(n)[None], torch.zeros(1, dtype=torch.long), k, v,
                                input_hidden=torch.cat(feats)[None])
            self.memo[path] = (out.logits[0, -1], out.hidden[0, -1])
        return self.memo[path]


def test_eagle_chain_and_static_tree_equal_brute_force(target64):
    head, args, catch_hid, rows = eagle_setup(target64)
    zeros = torch.zeros(B)
    tokens, ck, _ = draft_chain(head, *args, 4, zeros, zeros.long(), torch.ones(B), torch.rand(B, 4),
                                ctx=CTX, catch_hidden=catch_hid)
    assert ck.shape == (1, B, KV_HEADS, W, D)
    tpl = from_choices(MC_SIM_7B_63)
    tree, _, _ = draft_static_tree(head, *args, tpl, CTX, catch_hidden=catch_hid)
    for b in range(B):
        ref = BruteForce(head, *rows[b])
        path = []
        for _ in range(4):
            path.append(int(ref(path)[0].argmax()))
        assert tokens[b, 1:].tolist() == path
        node_path = {0: []}
        for i in range(1, tpl.num_nodes):
            parent = node_path[tpl.parents[i]]
            want = int(ref(parent)[0].topk(tpl.ranks[i] + 1).indices[-1])
            assert int(tree[b, i]) == want, (b, i)
            node_path[i] = parent + [want]


def test_eagle_topk_tree_equals_brute_force(target64):
    head, args, catch_hid, rows = eagle_setup(target64, seed=3)
    depth, K, N = 3, 3, 8
    tokens, parents, _, _ = draft_topk_tree(head, *args, depth, K, N, CTX, catch_hidden=catch_hid)
    for b in range(B):
        ref = BruteForce(head, *rows[b])
        # Expand the best K frontier paths per depth by cumulative log-probability; keep the best N overall.
        cands, frontier = [], [((), 0.0)]
        for _ in range(depth):
            children = []
            for path, score in frontier:
                logp = ref(path)[0].log_softmax(-1)
                top = logp.topk(K)
                children += [(path + (int(t),), score + float(s)) for s, t in zip(top.values, top.indices, strict=True)]
            cands += children
            frontier = sorted(children, key=lambda c: -c[1])[:K]
        want = {p for p, _ in sorted(cands, key=lambda c: -c[1])[:N]}
        got = set()
        for i in range(1, N + 1):
            path, j = [], i
            while j > 0:
                path.append(int(tokens[b, j]))
                j = int(parents[b, j])
            got.add(tuple(reversed(path)))
        assert got == want


# ---- EAGLE-3 ----

E3_VOCAB = torch.arange(0, V, 3)  # every third target token: d2t offsets 0, 2, 4, ...


def eagle3_state(prefix="midlayer.", seed=0, inter=96, nf=2, fc_bias=False, embed=False):
    """An EAGLE-3 state dict in SafeAILab (midlayer.*) or speculators (layers.0.*) key names."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    p, Vd = prefix, E3_VOCAB.numel()
    sd = {"fc.weight": r(H, nf * H), p + "input_layernorm.weight": 1 + r(H), p + "hidden_norm.weight": 1 + r(H),
          p + "post_attention_layernorm.weight": 1 + r(H),
          p + "self_attn.q_proj.weight": r(HEADS * D, 2 * H), p + "self_attn.k_proj.weight": r(KV_HEADS * D, 2 * H),
          p + "self_attn.v_proj.weight": r(KV_HEADS * D, 2 * H), p + "self_attn.o_proj.weight": r(H, HEADS * D),
          p + "mlp.gate_proj.weight": r(inter, H), p + "mlp.up_proj.weight": r(inter, H),
          p + "mlp.down_proj.weight": r(H, inter), "norm.weight": 1 + r(H), "lm_head.weight": r(Vd, H),
          "d2t": E3_VOCAB - torch.arange(Vd), "t2d": torch.zeros(V, dtype=torch.bool).index_fill(0, E3_VOCAB, True)}
    if fc_bias:
        sd["fc.bias"] = r(H)
    if embed:
        sd["embed_tokens.weight"] = r(V, H)
    return sd


def eagle3_reference(sd, prefix, cfg, tokens, feats, emb_weight, norm_before_residual):
    """The EAGLE-3 layer from transformers' Llama modules (q/k/v widened to 2H), as cnets.py / speculators
    compute it: fc, the two input norms, attention over cat(embedding, feature), MLP, norm, lm_head."""
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

    hf_cfg = transformers.LlamaConfig(**cfg)
    hf_cfg._attn_implementation = "eager"
    get = lambda k: sd[prefix + k]  # noqa: E731
    attn = LlamaAttention(hf_cfg, layer_idx=0)
    for n in "qkv":
        setattr(attn, f"{n}_proj", torch.nn.Linear(2 * H, get(f"self_attn.{n}_proj.weight").shape[0], bias=False))
    attn.load_state_dict({k.removeprefix("self_attn."): sd[prefix + k] for k in
                          [f"self_attn.{n}_proj.weight" for n in "qkvo"]})
    mlp = LlamaMLP(hf_cfg)
    mlp.load_state_dict({k.removeprefix("mlp."): sd[prefix + k] for k in
                         [f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]})
    norms = {}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        norms[n] = LlamaRMSNorm(H, eps=hf_cfg.rms_norm_eps)
        norms[n].weight.data.copy_(get(n + ".weight"))
    final = LlamaRMSNorm(H, eps=hf_cfg.rms_norm_eps)
    final.weight.data.copy_(sd["norm.weight"])
    B, T = tokens.shape
    pos = torch.arange(T).expand(B, T)
    h = F.linear(feats, sd["fc.weight"], sd.get("fc.bias"))
    emb = F.embedding(tokens, emb_weight)
    if norm_before_residual:
        h = norms["hidden_norm"](h)
        residual = h
    else:
        residual, h = h, norms["hidden_norm"](h)
    x = torch.cat([norms["input_layernorm"](emb), h], dim=-1)
    causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, T, T)
    a = attn(x, position_embeddings=LlamaRotaryEmbedding(hf_cfg)(x, pos), attention_mask=causal)[0]
    x = residual + a
    out = x + mlp(norms["post_attention_layernorm"](x))
    return out, final(out) @ sd["lm_head.weight"].t()


@pytest.mark.parametrize("layout", ["safeailab", "speculators"])
def test_eagle3_loads_published_layouts_and_matches_transformers_modules(tmp_path, ckpt, target, layout):
    speculators = layout == "speculators"
    prefix = "layers.0." if speculators else "midlayer."
    sd = eagle3_state(prefix, fc_bias=speculators, embed=speculators)
    save_file(sd, str(tmp_path / "model.safetensors"))
    layer = {**ckpt.config.to_hf(), "num_hidden_layers": 1, "intermediate_size": 96}
    layer.pop("rope_parameters")  # SafeAILab's configs leave RoPE at transformers' defaults
    if speculators:
        cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
               "transformer_layer_config": layer, "draft_vocab_size": int(E3_VOCAB.numel()),
               "norm_before_residual": True, "eagle_aux_hidden_state_layer_ids": [0, 1],
               "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}}}
    else:
        cfg = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": int(E3_VOCAB.numel())}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    head = load_eagle3(tmp_path, target)
    assert head.feature_layers == (0, 1) and head.norm_before_residual is speculators
    assert (head.tok_embeddings is target.tok_embeddings) is not speculators
    B, T = 2, 7
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (B, T), generator=g)
    feats = torch.randn(B, T, 2 * H, generator=g)
    emb = sd["embed_tokens.weight"] if speculators else target.tok_embeddings.weight
    with torch.no_grad():
        ref_hidden, ref_small = eagle3_reference(sd, prefix, layer, tokens, feats, emb, speculators)
        k, v = head.empty_cache(B, 16)
        got = head(tokens, torch.arange(T).expand(B, T), torch.zeros(B, dtype=torch.long), k, v, input_hidden=feats)
        # A drafted node reads the head's own output (width H), which skips fc.
        own = head(tokens[:, :1], torch.zeros(B, 1, dtype=torch.long), torch.zeros(B, dtype=torch.long), k, v,
                   input_hidden=got.hidden[:, :1])
    assert torch.allclose(got.hidden, ref_hidden, atol=1e-5)
    assert torch.allclose(got.logits[..., E3_VOCAB], ref_small, atol=1e-5)  # draft index i is target token 3i
    outside = torch.ones(V, dtype=torch.bool).index_fill(0, E3_VOCAB, False)
    assert (got.logits[..., outside] == torch.finfo(torch.float32).min).all()
    assert own.hidden.shape == (B, 1, H)


def test_eagle3_save_load_round_trip(tmp_path, target):
    head = randomise(Eagle3Head(target, draft_vocab=E3_VOCAB))
    save_eagle3(head, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == E3_VOCAB.numel() and cfg["eagle_aux_hidden_state_layer_ids"] == [0, 1]
    loaded = load_eagle3(tmp_path, target)
    for (n, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


def test_eagle3_loader_refuses_bad_checkpoints(tmp_path, ckpt, target):
    layer = {**ckpt.config.to_hf(), "num_hidden_layers": 1, "intermediate_size": 96, "draft_vocab_size": 86}

    def write(name, sd, cfg=layer):
        d = tmp_path / name
        d.mkdir()
        save_file(sd, str(d / "model.safetensors"))
        if cfg is not None:
            (d / "config.json").write_text(json.dumps(cfg))
        return d

    cases = {
        "disagree": ({**eagle3_state(), "t2d": torch.ones(V, dtype=torch.bool)}, layer, "t2d and d2t disagree"),
        "other target": (eagle3_state(nf=3), layer, "fc.weight has shape"),
        "eagle1": (safeailab_state(), layer, "EAGLE-1/2 head"),
        "no config": (eagle3_state(), None, "no config.json"),
        "layers": (eagle3_state(), {**layer, "eagle_aux_hidden_state_layer_ids": [0, 5]}, "do not exist"),
        "vocab": ({**eagle3_state(), "d2t": torch.full((86,), V)}, layer, "draft_vocab ids must be in"),
    }
    for name, (sd, cfg, msg) in cases.items():
        with pytest.raises(ModelFormatError, match=msg):
            load_eagle3(write(name, sd, cfg), target)
    with pytest.raises(ModelFormatError, match="EAGLE-3 checkpoint"):
        load_eagle(write("e3", eagle3_state()), target)


def test_eagle3_draft_loops_equal_brute_force(target64):
    """The draft loops with an EAGLE-3 head: catch-up entries read target features through fc, drafted nodes
    their parent's output; brute force feeds fc's output for the first and the outputs for the rest."""
    head = randomise(Eagle3Head(target64))
    with torch.no_grad():
        for p in [*head.norm.parameters(), *head.lm_head.parameters()]:
            p.normal_(0, 0.3)
    g = torch.Generator().manual_seed(5)
    F3 = 2 * H
    draft_len, n_catch = torch.tensor([5, 11]), torch.tensor([2, 4])
    hist_tok, hist_feat = torch.randint(0, V, (B, 16), generator=g), torch.randn(B, 16, F3, generator=g).double()
    catch_tok, catch_feat = torch.randint(0, V, (B, W), generator=g), torch.randn(B, W, F3, generator=g).double()
    k, v = head.empty_cache(B, SLOTS)
    rows = []
    with torch.no_grad():
        for b in range(B):
            n, c = int(draft_len[b]), int(n_catch[b])
            out = head(hist_tok[b:b + 1, :n], torch.arange(n)[None], torch.zeros(1, dtype=torch.long),
                       *head.empty_cache(1, 1), input_hidden=hist_feat[b:b + 1, :n])
            k[:, b, :, :n], v[:, b, :, :n] = out.new_k[:, 0], out.new_v[:, 0]
            fused = head.fc(torch.cat([hist_feat[b, :n], catch_feat[b, :c]]))
            rows.append((torch.cat([hist_tok[b, :n], catch_tok[b, :c]]), fused))
    args = (catch_tok, n_catch, draft_len, k, v)
    tokens, _, _ = draft_chain(head, *args, 4, torch.zeros(B), torch.zeros(B, dtype=torch.long), torch.ones(B),
                                  torch.rand(B, 4), ctx=CTX, catch_hidden=catch_feat)
    tree, parents, _, _ = draft_topk_tree(head, *args, 3, 2, 5, CTX, catch_hidden=catch_feat)
    for b in range(B):
        ref = BruteForce(head, *rows[b])
        path = []
        for _ in range(4):
            path.append(int(ref(path)[0].argmax()))
        assert tokens[b, 1:].tolist() == path
        for i in range(1, 6):  # every kept node is its parent's top-1 or top-2 under brute force
            chain, j = [], i
            while j > 0:
                chain.append(int(tree[b, j]))
                j = int(parents[b, j])
            chain.reverse()
            assert chain[-1] in ref(chain[:-1])[0].topk(2).indices.tolist()


# ---- Medusa ----

def medusa_state(num_heads, num_layers, untied, prefix="", seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            sd[f"{prefix}{h}.{layer}.linear.weight"] = torch.randn(H, H, generator=g) * 0.2
            sd[f"{prefix}{h}.{layer}.linear.bias"] = torch.randn(H, generator=g) * 0.2
        if untied:
            sd[f"{prefix}{h}.{num_layers}.weight"] = torch.randn(V, H, generator=g) * 0.2
    return sd


def medusa_reference(sd, hidden, num_heads, num_layers, lm_weight, prefix=""):
    """FasterDecoding's forward, head by head: [x + SiLU(W x + b)] x L, then the head's Linear (or the LM head)."""
    out = []
    for h in range(num_heads):
        x = hidden
        for layer in range(num_layers):
            name = f"{prefix}{h}.{layer}.linear"
            x = x + F.silu(F.linear(x, sd[name + ".weight"], sd[name + ".bias"]))
        out.append(x @ sd.get(f"{prefix}{h}.{num_layers}.weight", lm_weight).t())
    return torch.stack(out, -2)


@pytest.mark.parametrize("untied,prefix,with_config", [(True, "", True), (True, "medusa_head.", False),
                                                      (False, "", True), (False, "medusa_head.", False)])
def test_medusa_loads_fasterdecoding_layout(tmp_path, target, untied, prefix, with_config):
    sd = medusa_state(3, 2, untied, prefix)
    save_file(sd, str(tmp_path / "medusa_lm_head.safetensors"))
    if with_config:
        (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2,
                                                          "base_model_name_or_path": "x"}))
    heads = load_medusa(tmp_path, target)
    assert (heads.num_heads, heads.num_layers, heads.tied) == (3, 2, not untied)
    lm = target.tok_embeddings.weight if target.output is None else target.output.weight
    hidden = torch.randn(2, 5, H)
    with torch.no_grad():
        got = heads(hidden)
    assert got.shape == (2, 5, 3, V)
    assert torch.allclose(got, medusa_reference(sd, hidden, 3, 2, lm, prefix), atol=1e-5)


def test_medusa_loader_refuses_bad_checkpoints(tmp_path, target):
    def attempt(name, sd, config=None, file="medusa_lm_head.safetensors"):
        d = tmp_path / name
        d.mkdir()
        save_file(sd, str(d / file))
        if config is not None:
            (d / "config.json").write_text(json.dumps(config))
        with pytest.raises(ModelFormatError) as e:
            load_medusa(d, target)
        return str(e.value)

    sd = medusa_state(2, 1, True)
    sd["1.0.linear.weight"] = torch.zeros(H, H + 1)
    assert "ResBlock" in attempt("shape", sd)
    sd = medusa_state(2, 1, True)
    sd["0.1.weight"] = torch.zeros(V + 1, H)
    assert "output" in attempt("vocab", sd)
    assert "medusa_num_heads" in attempt("cfg", medusa_state(2, 1, False), {"medusa_num_heads": 5})
    sd = medusa_state(2, 1, True)
    del sd["1.1.weight"]
    assert "all or none" in attempt("mixed", sd)
    assert "unexpected tensor" in attempt("foreign", {"lm_head.weight": torch.zeros(V, H)})
    d = tmp_path / "pt"
    d.mkdir()
    torch.save(medusa_state(1, 1, False), d / "medusa_lm_head.pt")
    with pytest.raises(ModelFormatError, match="pickle"):
        load_medusa(d, target)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("untied", [False, True])
def test_medusa_save_load_round_trip(tmp_path, ckpt, dtype, untied):
    target = build_model(ckpt.config, ckpt.state_dict, dtype)
    heads = MedusaHeads(target, 3, 1, untied=untied, draft_vocab=None if untied else torch.arange(0, V, 2))
    with torch.no_grad():
        for p in heads.own_parameters():
            p.normal_()
    save_medusa(heads, tmp_path)
    loaded = load_medusa(tmp_path, target)
    a, b = heads.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    x = torch.randn(2, H).to(dtype)
    with torch.no_grad():
        assert torch.equal(heads(x), loaded(x))


def test_medusa_tree_equals_brute_force_topk(tmp_path, target):
    sd = medusa_state(4, 1, False)
    save_file(sd, str(tmp_path / "medusa_lm_head.safetensors"))
    heads = load_medusa(tmp_path, target)
    tpl = from_choices(MC_SIM_7B_63)
    hidden, root = torch.randn(B, H), torch.tensor([17, 4])
    with torch.no_grad():
        tokens = medusa_tree(heads, hidden, root, tpl)
    lm = target.tok_embeddings.weight if target.output is None else target.output.weight
    logits = medusa_reference(sd, hidden, 4, 1, lm)  # [B, 4, V]
    for b in range(B):
        assert int(tokens[b, 0]) == int(root[b])
        for i, choice in enumerate(sorted(MC_SIM_7B_63, key=lambda c: (len(c), c)), start=1):
            order = logits[b, len(choice) - 1].argsort(descending=True)
            assert int(tokens[b, i]) == int(order[choice[-1]])
    with pytest.raises(ValueError, match="heads"):
        medusa_tree(heads, hidden, root, get_template("kary:5x1", 5))


# ---- MLPSpeculator ----

def speculator_state(n, inner, tie, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.3  # noqa: E731
    stages = 1 if tie else n
    sd = {}
    for i in range(stages):
        sd[f"speculator.emb.{i}.weight"] = r(V, inner)
        sd[f"speculator.head.{i}.weight"] = r(V, inner)
        sd[f"speculator.ln.{i}.weight"] = 1 + r(inner)
        sd[f"speculator.ln.{i}.bias"] = r(inner)
    for i in range(2 if tie else n):
        sd[f"speculator.proj.{i}.weight"] = r(inner, H if i == 0 else inner)
    return sd


def speculator_reference(sd, cfg, hidden, root, k):
    """vLLM's generate_proposals at temperature 0, written out stage by stage."""
    n, inner = cfg["n_predict"], cfg["inner_dim"]

    def w(kind, i, name="weight"):
        if cfg["tie_weights"]:  # every stage shares index 0, except the projections of stages >= 1 (index 1)
            i = min(i, 1) if kind == "proj" else 0
        return sd[f"speculator.{kind}.{i}.{name}"]

    state_weight = 0.5 ** (0.5 / n)
    emb_weight = math.sqrt((1 - state_weight ** 2) * (inner / 2))
    state = hidden
    if cfg["scale_input"]:
        state = state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + 1e-6) / 2 ** 0.5
    last, out = root, []
    for i in range(k):
        s = state @ w("proj", i).t() + F.embedding(last, w("emb", i)) * (emb_weight / state_weight)
        s = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w("ln", i) + w("ln", i, "bias")
        state = F.gelu(s)
        last = (state @ w("head", i).t()).argmax(-1)
        out.append(last)
    return torch.stack(out, 1)


@pytest.mark.parametrize("tie,scale,inner", [(False, False, 0), (True, True, 48)])
def test_mlp_speculator_loads_vllm_layout_and_greedy_chain_matches(tmp_path, target, tie, scale, inner):
    n = 3
    sd = speculator_state(n, inner or H, tie)
    save_file(sd, str(tmp_path / "model.safetensors"))
    cfg = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator", "vocab_size": V,
           "emb_dim": H, "inner_dim": inner, "n_predict": n, "top_k_tokens_per_head": [4, 3, 2],
           "n_candidates": 5, "tie_weights": tie, "scale_input": scale}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_mlp_speculator(tmp_path, target)
    hidden, root = torch.randn(B, H), torch.tensor([3, 77])
    zeros = torch.zeros(B)
    with torch.no_grad():
        tokens = mlp_speculator_chain(spec, hidden, root, n, zeros, zeros.long(), torch.ones(B),
                                      torch.rand(B, n), filtered=True)
    want = speculator_reference(sd, {**cfg, "inner_dim": inner or H}, hidden, root, n)
    assert torch.equal(tokens[:, 0], root) and torch.equal(tokens[:, 1:], want)
    with torch.no_grad():  # teacher-forced stages equal the chain's when fed the chain's own tokens
        assert torch.equal(spec(hidden, tokens[:, :n]).argmax(-1), want)

    save_mlp_speculator(spec, tmp_path / "again")
    again = load_mlp_speculator(tmp_path / "again", target)
    a, b = spec.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_mlp_speculator_loader_refuses_bad_checkpoints(tmp_path, target):
    sd = speculator_state(2, H, False)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelFormatError, match="config.json"):
        load_mlp_speculator(tmp_path, target)
    base = {"vocab_size": V, "emb_dim": H, "inner_dim": 0, "n_predict": 2, "tie_weights": False}
    (tmp_path / "config.json").write_text(json.dumps({**base, "emb_dim": 128}))
    with pytest.raises(ModelFormatError, match="hidden size"):
        load_mlp_speculator(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps({**base, "n_predict": 3}))
    with pytest.raises(ModelFormatError, match="missing tensor"):
        load_mlp_speculator(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps({**base, "inner_dim": 32}))
    with pytest.raises(ModelFormatError, match="shape"):
        load_mlp_speculator(tmp_path, target)


# ---- every new graph compiles with fullgraph=True and matches eager ----

@pytest.fixture
def strict_dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def compiled_equals_eager(fn, *args):
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    with torch.no_grad():
        want, got = fn(*args), compiled(*args)
    for a, b in zip(want, got, strict=True):
        assert torch.allclose(a, b, atol=1e-5) if a.is_floating_point() else torch.equal(a, b)
    return want


def test_eagle_draft_loops_compile(target, strict_dynamo):
    head = randomise(EagleHead(target, draft_vocab=torch.arange(0, V, 2)))
    g = torch.Generator().manual_seed(0)
    catch, n_catch, draft_len = torch.randint(0, V, (B, W), generator=g), torch.tensor([1, 4]), torch.tensor([3, 9])
    catch_hid = torch.randn(B, W, H, generator=g)
    k, v = head.empty_cache(B, SLOTS)
    k.normal_(generator=g)
    v.normal_(generator=g)

    def loop(catch, n_catch, draft_len, k, v, catch_hid):
        # One feed level: compile time is the budget. The static tree and the chain route hidden states with
        # the same indexing ops their Transformer-draft versions compile with (tests/test_graph_compile.py).
        return draft_topk_tree(head, catch, n_catch, draft_len, k, v, 2, 2, 4, CTX, catch_hidden=catch_hid)

    out = compiled_equals_eager(loop, catch, n_catch, draft_len, k, v, catch_hid)
    assert all(int(t) % 2 == 0 for t in out[0][:, 1:].flatten())  # drafted tokens come from the draft vocabulary


def test_eagle3_draft_loop_compiles(target, strict_dynamo):
    head = randomise(Eagle3Head(target, draft_vocab=E3_VOCAB))
    g = torch.Generator().manual_seed(0)
    catch, n_catch, draft_len = torch.randint(0, V, (B, W), generator=g), torch.tensor([1, 4]), torch.tensor([3, 9])
    catch_feat = torch.randn(B, W, 2 * H, generator=g)
    k, v = head.empty_cache(B, SLOTS)

    def loop(catch, n_catch, draft_len, k, v, catch_feat):
        return draft_topk_tree(head, catch, n_catch, draft_len, k, v, 2, 2, 4, CTX, catch_hidden=catch_feat)

    out = compiled_equals_eager(loop, catch, n_catch, draft_len, k, v, catch_feat)
    assert all(int(t) % 3 == 0 for t in out[0][:, 1:].flatten())  # drafted tokens come from the draft vocabulary


def test_head_graphs_compile(target, strict_dynamo):
    medusa = MedusaHeads(target, 3, 1, draft_vocab=torch.arange(V // 2))
    spec = MLPSpeculator(target, 3, 32)
    with torch.no_grad():
        for p in [*medusa.own_parameters(), *spec.parameters()]:
            p.normal_(std=0.3)
    tpl = get_template("kary:3x2", 3)
    sampling = (torch.tensor([0.0, 0.8]), torch.tensor([0, 20]), torch.tensor([1.0, 0.9]), torch.rand(B, 3))

    def heads(hidden, root, temperature, top_k, top_p, uniforms):
        return (medusa_tree(medusa, hidden, root, tpl),
                mlp_speculator_chain(spec, hidden, root, 3, temperature, top_k, top_p, uniforms, filtered=True))

    out = compiled_equals_eager(heads, torch.randn(B, H), torch.tensor([1, 2]), *sampling)
    assert (out[0][:, 1:] < V // 2).all()
