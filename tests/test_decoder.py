"""The decoder vocabulary (issue 37, first slice), in-process on tiny shapes: the spec (``repeat``
blocks, tied dense layers, the new words an adapter must build), parameter and FLOP counts of the
shipped language models against their published figures and an independent formula, and the
NumPy reference, which defines each convention: gradients against finite differences, and each
trap of the issue shown to change the numbers (RoPE pairing and base, the causal mask, grouped
key/value heads, RMSNorm's scale form, tied output, SwiGLU's gate and up).

Over 400 lines: the spec, the reference's conventions, the token data and text, and the checks of a
language model are one feature; its tests share the tiny networks at the top.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest
import yaml
from pydantic import TypeAdapter

from benchbackend.backends.numpy import transformer as tr
from benchbackend.backends.numpy.reference import Network
from benchbackend.backends.registry import BACKENDS
from benchbackend.backends.spec import CNN_LAYERS, DECODER_LAYERS, TRANSFORMER_LAYERS
from benchbackend.errors import WorkloadError
from benchbackend.spec import graph as graph_mod
from benchbackend.spec import model, workload
from benchbackend.spec.layers import Attention, Rope
from benchbackend.spec.repeat import expand_repeats
from benchbackend.spec.workload import Layer
from conftest import ROOT, cli, invoke, numeric_grad, one_line_error

T, V, D = 5, 7, 8  # tokens, vocabulary, width of the tiny networks


def layers_of(specs: Sequence[dict]) -> list[Any]:
    return TypeAdapter(list[Layer]).validate_python(expand_repeats(list(specs)))


def net_of(specs: Sequence[dict], seed: int = 0) -> Network:
    g = graph_mod.resolve_layers(layers_of(specs), (T,))
    rng = np.random.default_rng(seed)
    weights = [rng.standard_normal(s) * (0.5 if k else 0.3) + (1.0 if n.kind == "rmsnorm" else 0.0)
               for n in g.nodes for s, k in zip(n.weights, n.kernel)]
    return Network(g, weights)


def tokens(n: int = 3, seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (n, T)).astype(np.float64)


def attention_spec(**fields: Any) -> dict:
    return {"type": "attention", "heads": 4, "head_dim": 2, "name": "attn", **fields}


EMBED = [{"type": "embedding", "vocab": V, "width": D, "name": "tok"}]
HEAD = [{"type": "dense", "units": V, "activation": "softmax"}]
CASES = {
    "rmsnorm_w": [{"type": "rmsnorm", "epsilon": 1e-3}],
    "rmsnorm_one_plus_w": [{"type": "rmsnorm", "epsilon": 1e-3, "scale": "one_plus_w"}],
    "causal_rope_half": [attention_spec(causal=True, rope={"base": 100.0})],
    "causal_rope_interleaved_gqa_no_bias": [attention_spec(causal=True, kv_heads=2, use_bias=False,
                                                           rope={"base": 100.0, "pairing": "interleaved"})],
    "multi_query": [attention_spec(kv_heads=1, causal=True)],
    "swiglu": [{"type": "dense", "units": 6, "activation": "silu", "use_bias": False, "name": "gate"},
               {"type": "dense", "units": 6, "inputs": ["tok"], "name": "up"},
               {"type": "multiply", "inputs": ["gate", "up"]}, {"type": "dense", "units": D}],
}
TIED = [{"type": "dense", "units": V, "tied_to": "tok", "use_bias": False, "activation": "softmax"}]


def check_gradients(net: Network, x: np.ndarray) -> None:
    y = np.eye(V)[np.random.default_rng(3).integers(0, V, x.shape)]  # one label per position
    _, grads, _ = net.loss_and_grads(x, y)
    for i, (w, g) in enumerate(zip(net.params(), grads)):
        np.testing.assert_allclose(g, numeric_grad(lambda: float(net.loss(x, y)), w), rtol=1e-5, atol=1e-8,
                                   err_msg=f"trainable array {i}")


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_finite_differences(case: str) -> None:
    check_gradients(net_of(EMBED + CASES[case] + HEAD), tokens())


def test_a_tied_output_layer_trains_the_one_table_from_both_ends() -> None:
    net = net_of(EMBED + CASES["rmsnorm_w"] + TIED)
    assert len(net.weights) == 2 and net.graph.nodes[-1].tied == 0  # the table, rmsnorm's w: no kernel of its own
    check_gradients(net, tokens())
    untied = net_of(EMBED + CASES["rmsnorm_w"] + [dict(TIED[0], tied_to=None)])
    untied.weights[2][...] = net.weights[0].T  # the same numbers, as a copy: the forward pass agrees...
    untied.weights[0][...], untied.weights[1][...] = net.weights[0], net.weights[1]
    x, y = tokens(), np.eye(V)[np.random.default_rng(3).integers(0, V, (3, T))]
    np.testing.assert_allclose(untied.forward(x), net.forward(x), rtol=1e-12)
    tied_grad, untied_grad = net.loss_and_grads(x, y)[1][0], untied.loss_and_grads(x, y)[1][0]
    assert np.abs(tied_grad - untied_grad).max() > 1e-3  # ...but an untied copy trains another network


def test_the_causal_mask_keeps_every_position_blind_to_later_tokens() -> None:
    for causal in (True, False):
        net = net_of(EMBED + [attention_spec(causal=causal, rope={})] + HEAD)
        x = tokens(1)
        changed = x.copy()
        changed[0, 3:] = (changed[0, 3:] + 1) % V  # tokens 3.. differ
        a, b = net.forward(x), net.forward(changed)
        if causal:
            np.testing.assert_array_equal(a[0, :3], b[0, :3])  # positions 0..2 cannot see them
            assert np.abs(a[0, 3] - b[0, 3]).max() > 1e-6  # position 3 sees itself (no off-by-one)
        else:
            assert np.abs(a[0, :3] - b[0, :3]).max() > 1e-6  # the trap: an open attention leaks the future
    # The bounds of the mask: token 0 attends to itself alone (its output is its own value, projected:
    # a mask shifted by one leaves it nothing), and the last token to every token, as an open attention
    x = np.random.default_rng(4).standard_normal((1, T, D))
    w = [np.random.default_rng(5 + i).standard_normal(s) for i, s in enumerate([(D, D), (D,)] * 4)]
    causal, open_ = (tr.attention(x, w, Attention(type="attention", heads=4, head_dim=2, causal=c))[0]
                     for c in (True, False))
    np.testing.assert_allclose(causal[0, 0], (x[0, 0] @ w[4] + w[5]) @ w[6] + w[7], rtol=1e-12)
    np.testing.assert_allclose(causal[0, -1], open_[0, -1], rtol=1e-12)
    assert np.abs(causal[0, :-1] - open_[0, :-1]).max() > 1e-3


def rotate_complex(a: np.ndarray, base: float, interleaved: bool) -> np.ndarray:
    """RoPE as complex multiplication, written independently: (N, H, T, dh), pair i at position p
    times exp(i p base^(-2i/dh))."""
    dh = a.shape[-1]
    re, im = (a[..., 0::2], a[..., 1::2]) if interleaved else (a[..., :dh // 2], a[..., dh // 2:])
    p = np.arange(a.shape[2])[:, None]
    z = (re + 1j * im) * np.exp(1j * p * base ** (-np.arange(dh // 2) * 2.0 / dh))
    out = np.empty_like(a)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        out[..., :dh // 2], out[..., dh // 2:] = z.real, z.imag
    return out


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_rope_turns_pairs_by_position_and_only_relative_positions_reach_the_scores(pairing: str) -> None:
    a = np.random.default_rng(0).standard_normal((2, 3, 6, 8))
    got = tr.rope(a, Rope(base=50.0, pairing=pairing))
    np.testing.assert_allclose(got, rotate_complex(a, 50.0, pairing == "interleaved"), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(tr.rope(got, Rope(base=50.0, pairing=pairing), inverse=True), a, atol=1e-12)
    # The trap: the other pairing, or another base, turns other numbers
    other = "interleaved" if pairing == "half" else "half"
    assert np.abs(tr.rope(a, Rope(base=50.0, pairing=other)) - got).max() > 1e-2
    assert np.abs(tr.rope(a, Rope(base=500.0, pairing=pairing)) - got).max() > 1e-2
    # q at p and k at p' meet by p - p' only: the same vectors two positions later score the same
    q = np.broadcast_to(a[:1, :1, :1], (1, 1, 6, 8)).copy()
    k = np.broadcast_to(a[1:, :1, :1], (1, 1, 6, 8)).copy()
    rq, rk = tr.rope(q, Rope(pairing=pairing)), tr.rope(k, Rope(pairing=pairing))
    scores = rq[0, 0] @ rk[0, 0].T
    assert math.isclose(scores[3, 1], scores[5, 3], rel_tol=1e-9) and not math.isclose(scores[3, 1], scores[3, 2])


def test_grouped_heads_share_key_value_heads_in_blocks() -> None:
    net = net_of(EMBED + [attention_spec(kv_heads=2, use_bias=False)] + HEAD)
    node = net.graph.nodes[1]
    x = net.graph.weights_of(net.graph.nodes[0], net.weights)[0][tokens(1).astype(int)]  # the embedded tokens
    wq, wk, wv, wo = net.graph.weights_of(node, net.weights)
    got = tr.attention(x, [wq, wk, wv, wo], node.layer)[0]

    def naive(kv_of: Any) -> np.ndarray:  # one head at a time; query head h reads key/value head kv_of(h)
        heads = []
        for h in range(4):
            q = x[0] @ wq[:, 2 * h:2 * h + 2]
            k, v = (x[0] @ w[:, 2 * kv_of(h):2 * kv_of(h) + 2] for w in (wk, wv))
            s = q @ k.T / math.sqrt(2)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            heads.append((p / p.sum(axis=1, keepdims=True)) @ v)
        return np.concatenate(heads, axis=1) @ wo

    np.testing.assert_allclose(got[0], naive(lambda h: h // 2), rtol=1e-10)  # blocks: heads 0,1 -> 0; 2,3 -> 1
    assert np.abs(got[0] - naive(lambda h: h % 2)).max() > 1e-3  # the trap: interleaved grouping differs


def test_rmsnorm_scale_forms_and_epsilon() -> None:
    x = np.random.default_rng(0).standard_normal((2, 3, 4))
    w = np.random.default_rng(1).standard_normal(4)
    plain = tr.rmsnorm(x, w, 1e-5, one_plus=False)[0]
    np.testing.assert_allclose(plain, x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5) * w, rtol=1e-12)
    np.testing.assert_allclose(tr.rmsnorm(x, w - 1, 1e-5, one_plus=True)[0], plain, rtol=1e-12)
    assert np.abs(tr.rmsnorm(x, w, 1e-5, one_plus=True)[0] - plain).max() > 0.1  # the trap: 1 + w read as w
    # the initial values make both forms the identity scale
    for scale, start in (("w", 1.0), ("one_plus_w", 0.0)):
        w0 = model.initial_weights(workload.parse(nano_raw(norm_scale=scale)))[1]
        assert np.all(w0 == start), scale


def test_swiglu_gate_and_up_are_not_interchangeable() -> None:
    net = net_of(EMBED + CASES["swiglu"] + HEAD)
    swapped = net_of(EMBED + CASES["swiglu"] + HEAD)
    g = net.graph
    gate, up = (g.offsets[i] for i in (1, 2))
    swapped.weights[gate], swapped.weights[up] = net.weights[up], net.weights[gate]  # the trap: silu on up
    swapped.weights[up + 1] = np.zeros(6)  # up has a bias in the case; gate none: move it with the kernel
    assert np.abs(net.forward(tokens()) - swapped.forward(tokens())).max() > 1e-3


# --- the spec ---------------------------------------------------------------------------------------
def nano_raw(times: int = 2, norm_scale: str = "w", **data: Any) -> dict:
    return {
        "name": "tiny-lm", "seed": 0,
        "data": {"dataset": "tokens", "vocab": V, "context": T, "train": 16, "validation": 4, "test": 4, **data},
        "model": [
            {"type": "embedding", "vocab": V, "width": D, "name": "tok"},
            {"type": "repeat", "times": times, "name": "layer", "layers": [
                {"type": "rmsnorm", "scale": norm_scale},
                attention_spec(causal=True, kv_heads=2, use_bias=False, rope={}),
                {"type": "add", "inputs": ["input", "attn"], "name": "out"}]},
            {"type": "rmsnorm"},
            {"type": "dense", "units": V, "use_bias": False, "tied_to": "tok", "activation": "softmax"}],
        "training": {"optimizer": "adam", "lr": 0.01, "batch_size": 4, "epochs": 1},
    }


def test_a_repeat_is_its_layers_written_out_with_indexed_names() -> None:
    w = workload.parse(nano_raw(times=3))
    names = [layer.name for layer in w.model]
    assert names == ["tok", None, "layer0.attn", "layer0.out", None, "layer1.attn", "layer1.out",
                     None, "layer2.attn", "layer2.out", None, None]
    # `input` inside the block is the repetition's input: the embedding, then the previous output
    assert [w.model[i].inputs for i in (3, 6, 9)] == [["tok", "layer0.attn"], ["layer0.out", "layer1.attn"],
                                                       ["layer1.out", "layer2.attn"]]
    g = graph_mod.resolve(w)
    assert g.output.out_shape == (T, V) and w.next_token and w.input_shape == (T,) and w.num_classes == V
    assert workload.parse(nano_raw(times=3)).hash() == w.hash() != workload.parse(nano_raw(times=2)).hash()


@pytest.mark.parametrize("block, says", [
    ({"times": 0}, "`times` must be a whole number of at least 1"),
    ({"layers": []}, "`layers` must be a list of one or more layers"),
    ({"tiems": 2}, "unknown key `tiems`"),
    ({"layers": [{"type": "repeat", "times": 2, "layers": [{"type": "rmsnorm"}]}]}, "a repeat inside a repeat"),
])
def test_a_malformed_repeat_is_one_line_naming_it(block: dict, says: str) -> None:
    raw = nano_raw()
    raw["model"][1] = {**raw["model"][1], **block}
    with pytest.raises(WorkloadError) as err:
        workload.parse(raw, "tiny.yaml")
    assert says in str(err.value) and "model[1]" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("change, says", [
    (lambda m: m[-1].update(tied_to="nothing"), "`tied_to` 'nothing' must name an earlier embedding layer"),
    (lambda m: m[-1].update(units=V + 1), "it needs inputs of width 8 and 7 units"),
    (lambda m: m[1]["layers"][1].update(kv_heads=3), "`kv_heads` (3) must divide `heads` (4)"),
    (lambda m: m[-1].update(tied_to=None, units=V + 1), "must be (5, 7), one row of next-token scores"),
])
def test_a_decoder_that_does_not_fit_says_where(change: Any, says: str) -> None:
    raw = nano_raw()
    change(raw["model"])
    with pytest.raises((WorkloadError, ValueError)) as err:
        graph_mod.resolve(workload.parse(raw, "tiny.yaml"))
    assert says in str(err.value)


def test_token_data_fields_are_checked() -> None:
    with pytest.raises(WorkloadError, match="dataset tokens needs `context`"):
        workload.parse({**nano_raw(), "data": {"dataset": "tokens", "vocab": V, "train": 4, "validation": 0,
                                               "test": 4}})
    with pytest.raises(WorkloadError, match="`vocab` is for dataset tokens"):
        workload.parse({**nano_raw(), "data": {"dataset": "synthetic", "vocab": V, "input_shape": [4],
                                               "num_classes": 2, "train": 4, "validation": 0, "test": 4}})


# --- the shipped language models ------------------------------------------------------------------
def test_the_published_shapes_have_their_published_parameter_counts() -> None:
    assert model.param_count(workload.load("gpt2-124m")) == 124_439_808
    assert model.param_count(workload.load("llama-1b")) == 1_235_814_400
    nano = workload.load("gpt-nano")
    assert model.param_count(nano) == model.trainable_count(nano) and graph_mod.resolve(nano).output.out_shape == (
        128, 256)


@pytest.mark.parametrize("name", ["gpt2-124m", "llama-1b", "gpt-nano"])
def test_forward_flops_are_2n_per_token_plus_the_attention_term(name: str) -> None:
    """Independently: every matmul weight (kernels and the tied table) is 2 FLOPs per token, and each
    layer's q k^T and p v are 4 T^2 (heads x head_dim) per sequence; the norms, residual adds and
    activations add under 1%. Leaving out the attention term (15% of GPT-2's at T = 1,024) fails."""
    w = workload.load(name)
    g = graph_mod.resolve(w)
    t = w.input_shape[0]
    matmul = sum(math.prod(s) for n in g.nodes if n.kind in ("dense", "attention")
                 for s, k in zip(n.weights, n.kernel) if k)
    tied = sum(math.prod(g.nodes[n.tied].weights[0]) for n in g.nodes if n.tied is not None)
    attention = sum(4 * t * t * n.layer.heads * n.layer.head_dim for n in g.nodes if isinstance(n.layer, Attention))
    expected = 2 * t * (matmul + tied) + attention
    got = model.flops_per_sample(w)
    assert expected <= got <= expected * 1.01, (got, expected)
    assert got - attention < expected * 0.99 or name == "gpt-nano"


def test_every_decoder_convention_is_a_word_an_adapter_must_build() -> None:
    words = model.vocabulary(workload.load("gpt-nano"))
    assert {"embedding", "rmsnorm", "multiply", "silu", "causal", "rope", "kv_heads", "no_bias", "tied",
            "next_token"} <= words <= set(CNN_LAYERS + TRANSFORMER_LAYERS + DECODER_LAYERS)
    assert not {"causal", "rope", "next_token"} & model.vocabulary(workload.load("vit-tiny"))
    attention_only = replace(BACKENDS["numpy"], name="vit-only", builds=CNN_LAYERS + TRANSFORMER_LAYERS)
    why = attention_only.cannot_build(words)
    assert why.startswith("vit-only: layer types embedding, multiply, rmsnorm, the causal mask, ") and (
        "rotary positions" in why and why.endswith("not implemented by this adapter yet")), why


# --- token data and the checks of a language model ------------------------------------------------
def test_token_sequences_are_the_sources_with_next_token_labels() -> None:
    from benchbackend.data import datasets, language

    w = workload.parse(nano_raw())
    ds = language.token_sequences(w)
    assert ds.x_train.shape == (16, T) and ds.x_train.dtype == np.int32 and ds.y_train.dtype == np.int64
    assert (ds.x_val.shape, ds.x_test.shape) == ((4, T), (4, T))
    np.testing.assert_array_equal(ds.x_train[:, 1:], ds.y_train[:, :-1])  # the label at t is the token at t + 1
    assert 0 <= ds.x_train.min() and ds.y_train.max() < V
    again = language.token_sequences(w)
    np.testing.assert_array_equal(again.x_test, ds.x_test)
    assert not np.array_equal(ds.x_val, ds.x_test)  # each split its own stream
    assert datasets.normalize(ds.x_train).dtype == np.float32


def test_the_token_checks_judge_the_validation_loss_against_the_datas_floor_and_unigram_entropy() -> None:
    from benchbackend.run import checks

    w = workload.load("gpt-nano")
    floor, unigram = checks.token_bounds(w)
    assert 0 < floor < math.log(4) < unigram <= math.log(256)  # 4 successors per byte: below log 4
    epoch = {"phase": "train_epoch", "loss": 2.0}
    assert checks.cell_status([dict(epoch, val_loss=0.5 * floor)], w)[0] == "future_leak"
    assert checks.cell_status([dict(epoch, val_loss=unigram)], w)[0] == "chance_accuracy"
    assert checks.cell_status([dict(epoch, val_loss=(floor + unigram) / 2)], w) == ("ok", "")
    assert checks.cell_status([dict(epoch, val_loss=floor * 0.95)], w) == ("ok", "")  # within the sampling margin
    assert checks.token_bounds(workload.load("mnist")) is None


def tiny_lm(tmp_path: Any, name: str, causal: bool = True) -> str:
    """A one-block Llama-style model over 16 token ids that learns its Markov data in seconds."""
    raw = {
        "name": name, "seed": 0,
        "data": {"dataset": "tokens", "vocab": 16, "context": 16, "train": 512, "validation": 256, "test": 64},
        "model": [
            {"type": "embedding", "vocab": 16, "width": 32, "name": "tok"},
            {"type": "repeat", "times": 1, "name": "layer", "layers": [
                {"type": "rmsnorm"},
                {"type": "attention", "heads": 2, "head_dim": 16, "causal": causal, "use_bias": False, "rope": {},
                 "name": "attn"},
                {"type": "add", "inputs": ["input", "attn"], "name": "mid"},
                {"type": "rmsnorm", "name": "norm"},
                {"type": "dense", "units": 64, "use_bias": False, "activation": "silu", "name": "gate"},
                {"type": "dense", "units": 64, "use_bias": False, "inputs": ["norm"], "name": "up"},
                {"type": "multiply", "inputs": ["gate", "up"]},
                {"type": "dense", "units": 32, "use_bias": False, "name": "down"},
                {"type": "add", "inputs": ["mid", "down"]}]},
            {"type": "rmsnorm"},
            {"type": "dense", "units": 16, "use_bias": False, "tied_to": "tok", "activation": "softmax"}],
        "training": {"optimizer": "adam", "lr": 0.01, "batch_size": 32, "epochs": 3},
        "inference": {"batch_size": 64, "repeats": 2},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_a_model_that_sees_the_next_token_ends_future_leak_in_a_real_run(tmp_path: Any) -> None:
    """The classic silent bug, planted in the spec (``causal: false``): the reference and every
    adapter agree, the loss falls fast, and only the data's floor shows what happened."""
    from benchbackend import results

    out = {}
    for name, causal in (("tiny-lm", True), ("tiny-leak", False)):
        csv = tmp_path / f"{name}.csv"
        got = cli("run", tiny_lm(tmp_path, name, causal), "-b", "numpy", "--data", "synthetic", "--repeats", "1",
                  "--parity-steps", "3", "--no-plots", "-o", str(csv))
        assert got.returncode in (0, 1) and "Traceback" not in got.stderr, got.stderr[-2000:]
        df = results.read(csv)
        out[name] = df
    floor, unigram = checks_bounds(tmp_path)
    ok, leak = (out[n][out[n]["phase"] == "run"].iloc[0] for n in ("tiny-lm", "tiny-leak"))
    assert ok["status"] == "ok", ok["message"]
    assert leak["status"] == "future_leak" and "below the data's entropy floor" in leak["message"]
    timed = out["tiny-lm"][out["tiny-lm"]["phase"].isin(["train_epoch", "inference"])]
    assert len(timed) == 5 and np.allclose(timed["tokens_per_s"], timed["samples_per_s"] * 16)  # context 16
    last = {n: df[df["phase"] == "train_epoch"]["val_loss"].iloc[-1] for n, df in out.items()}
    assert floor < last["tiny-lm"] < unigram - 0.5 and last["tiny-leak"] < 0.9 * floor


def checks_bounds(tmp_path: Any) -> tuple[float, float]:
    from benchbackend.run import checks

    return checks.token_bounds(workload.load(str(tmp_path / "tiny-lm.yaml")))


# --- the user's own text ----------------------------------------------------------------------------
#: Real text every machine has: the sources of Python's standard library (json: 48 KB; asyncio: 700 KB).
STDLIB = Path(json.__file__).parent.parent


def byte_lm(tmp_path: Any, vocab: int = 256) -> str:
    """gpt-nano's shape at a tenth of its width and context: learns bytes in seconds on the reference."""
    raw = yaml.safe_load((ROOT / "workloads" / "gpt-nano.yaml").read_text())
    raw["name"] = "byte-lm"
    raw["data"].update(vocab=vocab, context=32, train=1024, validation=64, test=32)
    raw["model"][0].update(vocab=vocab, width=32)
    block = raw["model"][1]
    block["times"] = 1
    block["layers"][1].update(heads=2, head_dim=16, kv_heads=1)
    for layer in block["layers"]:
        if layer.get("name") in ("gate", "up"):
            layer["units"] = 64
        if layer.get("name") == "down":
            layer["units"] = 32
    raw["model"][-1]["units"] = vocab
    raw["training"].update(lr=0.01, epochs=3)  # 96 steps: 2.55 nats on asyncio's sources, unigram 3.11
    raw["inference"] = {"batch_size": 32, "repeats": 2}
    path = tmp_path / "byte-lm.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_text_is_cut_in_windows_by_position_train_first_validation_and_test_last(tmp_path: Any) -> None:
    from benchbackend.data import language, tokens

    w = workload.load(byte_lm(tmp_path)).with_overrides(text=str(STDLIB / "json"), limit=512)
    assert w.data.dataset == "text" and w.num_classes == 256 and w.next_token
    ds = language.load(w)
    ids = tokens.byte_tokens(tokens.read_text(STDLIB / "json"))
    n = (len(ids) - 1) // 32
    np.testing.assert_array_equal(ds.x_train[1], ids[32:64])  # window 1, from the start
    np.testing.assert_array_equal(ds.y_train[1], ids[33:65])
    np.testing.assert_array_equal(ds.x_test[-1], ids[(n - 1) * 32:n * 32])  # the last whole window
    np.testing.assert_array_equal(ds.x_val[0], ids[(n - 96) * 32:(n - 95) * 32])
    assert (len(ds.x_train), len(ds.x_val), len(ds.x_test)) == (512, 64, 32) and ds.source == "text"


def test_text_above_256_ids_is_a_bpe_of_that_vocabulary(tmp_path: Any) -> None:
    from benchbackend.data import language

    pytest.importorskip("tokenizers", reason="tokenizers is not installed (the BPE option's library): "
                        "pip install 'benchbackend[text]'")
    bpe = language.load(workload.load(byte_lm(tmp_path, vocab=320)).with_overrides(text=str(STDLIB / "json"),
                                                                                   limit=512))
    assert 255 < bpe.x_train.max() < 320  # merges in use, every id inside the vocabulary


def test_a_run_on_real_text_learns_and_bad_text_options_are_one_line(tmp_path: Any) -> None:
    from benchbackend import results
    from benchbackend.run import checks

    csv = tmp_path / "text.csv"
    got = cli("run", byte_lm(tmp_path), "-b", "numpy", "--text", str(STDLIB / "asyncio"), "--repeats", "1",
              "--no-plots", "-o", str(csv))
    df = results.read(csv)
    run = df[df["phase"] == "run"].iloc[0]
    assert got.returncode == 0 and run["status"] == "ok", (run["message"], got.stderr[-2000:])
    w = workload.load(byte_lm(tmp_path)).with_overrides(text=str(STDLIB / "asyncio"))
    floor, unigram = checks.token_bounds(w)
    assert floor is None and df[df["phase"] == "train_epoch"]["val_loss"].iloc[-1] < unigram - 0.3
    assert one_line_error(invoke("run", "mnist", "-b", "numpy", "--text", str(STDLIB / "json"))).endswith(
        "--text is for language models (dataset tokens or text); this workload's data is mnist")
    short = tmp_path / "short.txt"
    short.write_text("too short for one window\n")
    got = cli("run", byte_lm(tmp_path), "-b", "numpy", "--text", str(short), "--no-plots",
              "-o", str(tmp_path / "s.csv"))
    assert got.returncode == 2 and got.stderr.strip().splitlines()[-1].startswith(f"Error: {short}: 25 tokens make 0 "
                                                                                   "windows of 32")
