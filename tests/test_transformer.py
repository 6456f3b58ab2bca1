"""The transformer layers (issue 21, first slice), in-process on tiny shapes: the spec, the NumPy
reference's forward and backward, GELU's two forms, layernorm's epsilon, attention against a naive
per-head loop, the canonical weights, parameter and FLOP counts against independent formulas, and
the registry's `unavailable` for adapters that do not build these layers yet."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence

import numpy as np
import pytest
import yaml
from pydantic import TypeAdapter

from benchbackend import results
from benchbackend.backends.numpy import transformer as tr
from benchbackend.backends.numpy.reference import Network, forward
from benchbackend.backends.registry import BACKENDS
from benchbackend.backends.spec import CNN_LAYERS, DECODER_LAYERS, TRANSFORMER_LAYERS, Mode
from benchbackend.errors import WorkloadError
from benchbackend.run import plan
from benchbackend.spec import graph as graph_mod
from benchbackend.spec import model, workload
from benchbackend.spec.layers import GELU_TANH, LAYER_TYPES, Attention, activation_name
from benchbackend.spec.workload import Layer
from conftest import ROOT, numeric_grad

EMBED = [{"type": "conv2d", "filters": 6, "kernel_size": 2, "stride": 2, "padding": "valid"}, {"type": "tokens"}]
HEAD = [{"type": "select_token"}, {"type": "dense", "units": 3, "activation": "softmax"}]


def net_of(specs: Sequence[dict], in_shape: tuple[int, ...] = (4, 4, 2), seed: int = 0) -> Network:
    layers = TypeAdapter(list[Layer]).validate_python(list(specs))
    g = graph_mod.resolve_layers(layers, in_shape)
    rng = np.random.default_rng(seed)
    weights = [rng.standard_normal(s) * (0.5 if k else 0.3) + (1.0 if n.kind == "layernorm" and j == 0 else 0.0)
               for n in g.nodes for j, (s, k) in enumerate(zip(n.weights, n.kernel))]
    return Network(g, weights)


def check_gradients(net: Network, x: np.ndarray, classes: int = 3) -> None:
    y = np.eye(classes)[np.random.default_rng(3).integers(0, classes, len(x))]
    _, grads, _ = net.loss_and_grads(x, y)
    for i, (w, g) in enumerate(zip(net.params(), grads)):
        # atol: the key bias has no gradient (softmax ignores a shift shared by every key)
        np.testing.assert_allclose(g, numeric_grad(lambda: float(net.loss(x, y)), w), rtol=1e-5, atol=1e-7,
                                   err_msg=f"trainable array {i}")


# Each new layer between a patch embedding (whose kernel's gradient needs every later layer's input
# gradient) and a head that reads a token.
CASES = {
    "class_token": [{"type": "class_token"}],
    "position_embedding": [{"type": "position_embedding"}],
    "layernorm": [{"type": "layernorm", "epsilon": 1e-3}],
    "attention": [{"type": "attention", "heads": 2, "head_dim": 3}],
    "dense_on_tokens": [{"type": "dense", "units": 5, "activation": "tanh"}],
    "gelu_exact": [{"type": "dense", "units": 5, "activation": "gelu"}],
    "gelu_tanh": [{"type": "dense", "units": 5}, {"type": "activation", "function": "gelu", "approximate": True}],
    "residual_block": [{"type": "class_token"}, {"type": "position_embedding", "name": "e"}, {"type": "layernorm"},
                       {"type": "attention", "heads": 2, "head_dim": 2, "name": "a"},
                       {"type": "add", "inputs": ["e", "a"]}],
}


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_finite_differences(case: str) -> None:
    net = net_of(EMBED + CASES[case] + HEAD)
    check_gradients(net, np.random.default_rng(1).standard_normal((3, 4, 4, 2)))


def test_global_avgpool_and_select_token_and_dropout_on_tokens() -> None:
    specs = EMBED + [{"type": "dropout", "rate": 0.5, "name": "t"}, {"type": "select_token", "index": 2, "name": "s"},
                     {"type": "global_avgpool", "inputs": ["t"], "name": "p"}, {"type": "add", "inputs": ["s", "p"]},
                     HEAD[1]]
    net = net_of(specs)
    x = np.random.default_rng(1).standard_normal((3, 4, 4, 2))
    check_gradients(net, x)  # dropout is off without an rng
    seq = np.arange(2 * 4 * 3, dtype=float).reshape(2, 4, 3)
    assert np.array_equal(tr.forward(net.graph.nodes[3].layer, seq, [])[0], seq[:, 2])
    out, mask = net._layer(net.graph.nodes[2], [seq], [], np.random.default_rng(0), True, False)
    assert out.shape == seq.shape and set(np.unique(mask)) <= {0.0, 2.0}


def test_gelu_exact_and_tanh_differ_and_match_their_formulas() -> None:
    z = np.linspace(-4, 4, 81)
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in z])
    tanh = 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))
    np.testing.assert_allclose(tr.gelu(z), exact, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(tr.gelu(z, approximate=True), tanh, rtol=1e-12, atol=1e-15)
    assert np.abs(exact - tanh).max() > 1e-4  # the trap is real: the two forms differ visibly
    for approximate in (False, True):
        f = lambda v, a=approximate: float(tr.gelu(np.array(v), a).sum())  # noqa: E731
        numeric = np.array([(f(v + 1e-6) - f(v - 1e-6)) / 2e-6 for v in z])
        np.testing.assert_allclose(tr.gelu_backward(np.ones_like(z), z, approximate), numeric, atol=1e-8)


def test_inline_gelu_is_exact_and_approximate_is_only_for_gelu() -> None:
    layer = TypeAdapter(Layer).validate_python({"type": "dense", "units": 2, "activation": "gelu"})
    assert activation_name(layer, "gelu") == "gelu"
    tanh = TypeAdapter(Layer).validate_python({"type": "activation", "function": "gelu", "approximate": True})
    assert activation_name(tanh, "gelu") == GELU_TANH
    with pytest.raises(ValueError, match="approximate"):
        TypeAdapter(Layer).validate_python({"type": "activation", "function": "relu", "approximate": True})


def test_layernorm_honours_its_epsilon() -> None:
    x = np.random.default_rng(0).standard_normal((2, 5, 4)) * 0.05  # small variance: epsilon matters
    gamma, beta = np.full(4, 1.5), np.full(4, 0.25)
    for eps in (1e-6, 1e-3):
        want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * gamma + beta
        np.testing.assert_allclose(tr.layernorm(x, gamma, beta, eps)[0], want, rtol=1e-12)
    assert np.abs(tr.layernorm(x, gamma, beta, 1e-6)[0] - tr.layernorm(x, gamma, beta, 1e-3)[0]).max() > 0.1
    default = TypeAdapter(Layer).validate_python({"type": "layernorm"})
    assert default.epsilon == 1e-6


def naive_attention(x: np.ndarray, w: Sequence[np.ndarray], heads: int, head_dim: int, scale: bool = True,
                    dim_major: bool = False) -> np.ndarray:
    """Per sample, per head, with loops: column h * head_dim + j of a q/k/v kernel is head h's
    dimension j (``dim_major``: the wrong, transposed reading j * heads + h)."""
    wq, bq, wk, bk, wv, bv, wo, bo = w
    out = np.zeros((x.shape[0], x.shape[1], wo.shape[1]))
    for n in range(x.shape[0]):
        q, k, v = x[n] @ wq + bq, x[n] @ wk + bk, x[n] @ wv + bv
        mixed = []
        for h in range(heads):
            cols = [j * heads + h if dim_major else h * head_dim + j for j in range(head_dim)]
            s = q[:, cols] @ k[:, cols].T / (math.sqrt(head_dim) if scale else 1.0)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            mixed.append(p @ v[:, cols])
        out[n] = np.concatenate(mixed, axis=1) @ wo + bo
    return out


def test_attention_is_the_naive_per_head_loop_scaled_by_one_over_sqrt_head_dim() -> None:
    heads, head_dim, d = 3, 4, 5
    rng = np.random.default_rng(2)
    shapes = [(d, heads * head_dim), (heads * head_dim,)] * 3 + [(heads * head_dim, d), (d,)]
    w = [rng.standard_normal(s) for s in shapes]
    x = rng.standard_normal((2, 6, d))
    got = tr.attention(x, w, Attention(type="attention", heads=heads, head_dim=head_dim))[0]
    np.testing.assert_allclose(got, naive_attention(x, w, heads, head_dim), rtol=1e-12, atol=1e-12)
    # An unscaled or a transposed (dim-major) attention would fail the line above by this much:
    assert np.abs(got - naive_attention(x, w, heads, head_dim, scale=False)).max() > 1e-2
    assert np.abs(got - naive_attention(x, w, heads, head_dim, dim_major=True)).max() > 1e-2


def test_float32_forward_agrees_with_float64() -> None:
    w = workload.load("vit-tiny")
    weights = model.initial_weights(w)
    x = np.random.default_rng(0).uniform(0, 1, (4, 32, 32, 3))
    f64, f32 = forward(w, weights, x), forward(w, weights, x, dtype=np.float32)
    assert np.abs(f64 - f32).max() < 1e-5 and np.allclose(f64.sum(axis=1), 1.0)


def vit_params(patch: int, channels: int, tokens: int, d: int, depth: int, mlp: int, classes: int) -> int:
    """ViT's parameters, counted as torchvision's vit_b_16 holds them."""
    embed = patch * patch * channels * d + d + d + (tokens + 1) * d  # conv, class token, positions
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * mlp + mlp) + (mlp * d + d)
    return embed + depth * block + 2 * d + d * classes + classes


def vit_macs(patch: int, channels: int, tokens: int, d: int, depth: int, heads: int, mlp: int, classes: int) -> int:
    """Multiply-adds of the matrix products: patch embedding, q/k/v/output projections, q k^T and
    p v per head, the MLP, the classifier."""
    t = tokens + 1
    block = 4 * t * d * d + 2 * heads * t * t * (d // heads) + 2 * t * d * mlp
    return tokens * patch * patch * channels * d + depth * block + d * classes


def test_vit_b16_has_torchvisions_parameters_and_about_17_6_g_multiply_adds() -> None:
    w = workload.load("vit-b16")
    assert model.param_count(w) == vit_params(16, 3, 196, 768, 12, 3072, 1000) == 86_567_656
    assert model.trainable_count(w) == model.param_count(w)
    macs = vit_macs(16, 3, 196, 768, 12, 12, 3072, 1000)
    elementwise = 12 * (2 * 2 * 197 * 768 + 2 * 197 * 768) + 2 * 197 * 768 + 197 * 768  # norms, adds, positions
    assert model.flops_per_sample(w) == 2 * macs + elementwise
    assert macs == 17_563_828_224 and round(model.flops_per_sample(w) / 2e9, 2) == 17.57
    attention_products = 12 * 2 * 12 * 197 * 197 * 64
    assert sum(n.flops for n in model.describe(w) if n.kind == "attention") == 12 * 2 * 4 * 197 * 768 * 768 + \
        2 * attention_products


def test_vit_tiny_is_about_a_million_parameters() -> None:
    w = workload.load("vit-tiny")
    assert model.param_count(w) == vit_params(4, 3, 64, 192, 4, 384, 10) == 1_212_490
    assert w.training.weight_decay is not None and w.training.weight_decay.kind == "decoupled"


def test_initial_weights_follow_the_documented_init_and_decay_reaches_kernels_only() -> None:
    w = workload.load("vit-tiny")
    g = graph_mod.resolve(w)
    weights = model.initial_weights(w)
    by_kind = {n.kind: g.weights_of(n, weights) for n in g.nodes}
    assert not by_kind["class_token"][0].any()
    assert abs(float(by_kind["position_embedding"][0].std()) - 0.02) < 0.002
    gamma, beta = by_kind["layernorm"]
    assert (gamma == 1).all() and not beta.any()
    q, bq, *_, o, bo = by_kind["attention"]
    limit = math.sqrt(6 / (192 + 192))
    assert q.shape == (192, 192) and 0.9 * limit < np.abs(q).max() <= limit and not bq.any()
    decayed = [n.kind for n in g.nodes for k in n.kernel if k]
    assert set(decayed) == {"conv2d", "attention", "dense"} and decayed.count("attention") == 4 * 4
    # The CNNs keep their weights: new initializers draw nothing for them.
    assert workload.load("mnist").hash() == "a16752825596"


@pytest.mark.parametrize("specs, message", [
    ([{"type": "attention", "heads": 2, "head_dim": 3}], "needs a token sequence"),
    (EMBED + [{"type": "tokens"}], "needs an image input"),
    (EMBED + [{"type": "select_token", "index": 4}], "index 4 is past the 4 tokens"),
])
def test_layers_that_do_not_fit_name_themselves(specs: list[dict], message: str) -> None:
    layers = TypeAdapter(list[Layer]).validate_python(specs + HEAD)
    with pytest.raises(ValueError, match=message):
        graph_mod.resolve_layers(layers, (4, 4, 2))


def test_the_registry_declares_what_each_adapter_builds() -> None:
    assert set(CNN_LAYERS) | set(TRANSFORMER_LAYERS) | set(DECODER_LAYERS) >= set(LAYER_TYPES) | {"gelu"}
    assert set(BACKENDS["numpy"].builds) == set(CNN_LAYERS) | set(TRANSFORMER_LAYERS) | set(DECODER_LAYERS)
    words = model.vocabulary(workload.load("vit-tiny"))
    assert {"attention", "layernorm", "gelu", "tokens"} <= words
    assert model.vocabulary(workload.load("resnet8")) <= set(CNN_LAYERS)
    for name, spec in BACKENDS.items():
        why = spec.cannot_build(words)
        assert (why == "") == (set(TRANSFORMER_LAYERS) <= set(spec.builds)), name
        assert why == "" or why.startswith(f"{name}: layer types attention, class_token, layernorm")
    cnn_only = replace(BACKENDS["numpy"], name="cnn-only", builds=CNN_LAYERS)
    assert cnn_only.cannot_build(words).endswith("not implemented by this adapter yet")
    noted = replace(cnn_only, builds_note="its framework has no layer normalization")
    assert noted.cannot_build(words).endswith("not implemented: its framework has no layer normalization")


def test_a_mode_about_attention_is_unavailable_on_a_network_without_it() -> None:
    modes = (Mode("plain", "p"), Mode("fused", "f", needs=("attention",)))
    spec = replace(BACKENDS["numpy"], name="fused", modes=modes)
    vit, cnn = model.vocabulary(workload.load("vit-tiny")), model.vocabulary(workload.load("resnet8"))
    assert spec.cannot_build(vit, "fused") == "" and spec.cannot_build(cnn, "plain") == ""
    assert spec.cannot_build(cnn, "fused") == ("fused:fused is about attention layers and this network has none "
                                               "(it would time fused:plain again)")


def test_the_plan_gives_a_backend_that_cannot_build_a_vit_an_unavailable_choice(monkeypatch: Any) -> None:
    monkeypatch.setitem(BACKENDS, "torch", replace(BACKENDS["torch"], builds=CNN_LAYERS))
    loaded = [workload.load("vit-tiny"), workload.load("mnist")]
    choices = plan.resolve(["numpy", "torch"], [], [])
    cells = plan.cells(plan.RunPlan(workloads=loaded, choices=choices))
    problems = {(c.workload.name, c.choice.backend): c.choice.problem for c in cells}
    assert problems[("vit-tiny", "numpy")] == "" and problems[("mnist", "torch")] == ""
    assert "not implemented by this adapter yet" in problems[("vit-tiny", "torch")]


def test_a_user_transformer_with_other_sizes_loads() -> None:
    raw = {"name": "mine", "data": {"dataset": "synthetic", "input_shape": [8, 8, 1], "num_classes": 4,
                                    "train": 64, "validation": 16, "test": 16},
           "model": [{"type": "conv2d", "filters": 8, "kernel_size": 2, "stride": 2, "padding": "valid"},
                     {"type": "tokens"}, {"type": "layernorm", "epsilon": 1e-5},
                     {"type": "attention", "heads": 4, "head_dim": 5}, {"type": "global_avgpool"},
                     {"type": "dense", "units": 4, "activation": "softmax"}],
           "training": {"optimizer": "adam", "lr": 1e-3, "batch_size": 8, "epochs": 1}}
    w = workload.parse(raw)
    assert model.describe(w)[3].weights[0] == (8, 20) and model.describe(w)[3].out_shape == (16, 8)
    with pytest.raises(WorkloadError, match="heads"):
        workload.parse({**raw, "model": [{"type": "attention", "head_dim": 5}, *raw["model"][-1:]]})


def run_here(monkeypatch: Any, *args: str) -> Any:
    from click.testing import CliRunner
    from support import inprocess

    from benchbackend.cli import main

    inprocess.use(monkeypatch)
    return CliRunner().invoke(main, ["run", *args, "--no-plots", "--quiet"])


def test_vit_tiny_runs_on_numpy_and_a_backend_that_cannot_build_it_says_unavailable(tmp_path: Any,
                                                                                     monkeypatch: Any) -> None:
    monkeypatch.setitem(BACKENDS, "torch", replace(BACKENDS["torch"], builds=CNN_LAYERS))
    out_csv = tmp_path / "vit.csv"
    # inference-only, on 32 test images and one pass: training vit-tiny on numpy is test_vit_backends'
    # smoke; this is about the plan (single-threaded, 256 images x 5 passes took 55 s of the suite)
    spec = yaml.safe_load((ROOT / "workloads" / "vit-tiny.yaml").read_text())
    spec["data"].update(train=32, validation=32, test=32)
    spec["inference"] = {"batch_size": 32, "repeats": 1}
    (tmp_path / "vit-tiny.yaml").write_text(yaml.safe_dump(spec))
    out = run_here(monkeypatch, str(tmp_path / "vit-tiny.yaml"), "-b", "numpy", "-b", "torch", "--data", "synthetic",
                   "--inference-only", "--repeats", "1", "-o", str(out_csv))
    df = results.read(out_csv)
    assert out.exit_code == 1, out.output  # an unavailable cell fails the run (README: exit codes)
    torch_rows = df[df.backend == "torch"]
    assert torch_rows["status"].tolist() == ["unavailable"]
    assert "torch: layer types attention, class_token, layernorm" in torch_rows["message"].iloc[0]
    assert set(df[df.backend == "numpy"]["status"]) == {"ok"}, df[["phase", "status", "message"]]
