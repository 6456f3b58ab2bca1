"""The NumPy reference: gradients (finite differences), optimizers (hand computation and Keras),
the ``numpy`` backend, and forward/backward parity with PyTorch and TensorFlow on random layer
configurations (hypothesis, float64, tolerance 1e-10).

Over 400 lines: the reference is the ground truth every backend is checked against, so each
layer's gradient, each optimizer and each cross-framework parity has its own test here.
"""
from __future__ import annotations

import importlib.util
import math
import os
from typing import Any, Sequence

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from benchbackend.backends.numpy import ops, reference
from benchbackend.backends.numpy.reference import Network, NumpyBackend
from benchbackend.errors import BackendUnavailable
from benchbackend.run.checks import chance_accuracy, parity_errors
from benchbackend.spec import workload as wl_mod
from benchbackend.spec.graph import resolve_layers
from benchbackend.spec.model import conv_out, initial_weights, nhwc_to_nchw_rows, param_count, same_pads
from benchbackend.spec.workload import Conv2D, Dense, Flatten, Layer, MaxPool2D
from conftest import numeric_grad

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before any test imports TensorFlow

TIGHT = dict(rtol=1e-10, atol=1e-10)
PROPERTY = settings(max_examples=25, deadline=None)
ACTIVATIONS = ["none", "relu", "tanh", "sigmoid", "softmax"]


def layers(*specs: dict) -> list[Any]:
    return TypeAdapter(list[Layer]).validate_python(list(specs))


def random_weights(net_layers: Sequence[Any], in_shape: tuple[int, ...], rng: np.random.Generator,
                   ) -> tuple[list[np.ndarray], tuple[int, ...]]:
    """float64 weights (non-zero biases) for ``net_layers`` on ``in_shape``, and the output shape."""
    shape, weights = tuple(in_shape), []
    for layer in net_layers:
        if isinstance(layer, Conv2D):
            k = layer.kernel_size
            weights += [rng.standard_normal((k, k, shape[2], layer.filters)) * 0.5,
                        rng.standard_normal(layer.filters) * 0.1]
            shape = (conv_out(shape[0], k, layer.stride, layer.padding),
                     conv_out(shape[1], k, layer.stride, layer.padding), layer.filters)
        elif isinstance(layer, MaxPool2D):
            p, s = layer.pool_size, layer.stride or layer.pool_size
            shape = ((shape[0] - p) // s + 1, (shape[1] - p) // s + 1, shape[2])
        elif isinstance(layer, Flatten):
            shape = (int(np.prod(shape)),)
        elif isinstance(layer, Dense):
            weights += [rng.standard_normal((shape[0], layer.units)) * 0.5, rng.standard_normal(layer.units) * 0.1]
            shape = (layer.units,)
    return weights, shape


def net_of(net_layers: Sequence[Any], in_shape: Sequence[int], weights: Sequence[np.ndarray], l2: float = 0.0
           ) -> Network:
    """The reference network of ``net_layers`` on samples of ``in_shape``."""
    return Network(resolve_layers(net_layers, tuple(in_shape)), weights, l2)



# --- gradients -----------------------------------------------------------------------------------
GRAD_NETS = {
    "conv-same-valid-stride2-pool-dense": ((9, 9, 2), layers(
        {"type": "conv2d", "filters": 3, "kernel_size": 3, "padding": "same", "activation": "relu"},
        {"type": "conv2d", "filters": 4, "kernel_size": 3, "stride": 2, "padding": "valid", "activation": "tanh"},
        {"type": "maxpool2d", "pool_size": 2},
        {"type": "flatten"},
        {"type": "dense", "units": 5, "activation": "sigmoid"},
        {"type": "dense", "units": 3, "activation": "softmax"})),
    "even-kernel-overlapping-pool-softmax-layers": ((8, 8, 1), layers(
        {"type": "conv2d", "filters": 2, "kernel_size": 4, "padding": "same"},  # pads (1, 2): extra pixel after
        {"type": "activation", "function": "relu"},
        {"type": "conv2d", "filters": 3, "kernel_size": 2, "stride": 2, "padding": "same", "activation": "sigmoid"},
        {"type": "maxpool2d", "pool_size": 3, "stride": 1},
        {"type": "activation", "function": "softmax"},  # mid-network softmax over channels
        {"type": "flatten"},
        {"type": "dense", "units": 4},
        {"type": "activation", "function": "softmax"})),
    "odd-input-stride2-same-logits-output": ((7, 7, 2), layers(
        {"type": "conv2d", "filters": 3, "kernel_size": 2, "stride": 2, "padding": "same", "activation": "tanh"},
        {"type": "conv2d", "filters": 2, "kernel_size": 3, "padding": "valid", "activation": "relu"},
        {"type": "flatten"},
        {"type": "dense", "units": 3})),
}


@pytest.mark.parametrize("name", list(GRAD_NETS))
def test_gradients_match_finite_differences(name: str) -> None:
    in_shape, net_layers = GRAD_NETS[name]
    rng = np.random.default_rng(1)
    weights, (classes,) = random_weights(net_layers, in_shape, rng)
    net = net_of(net_layers, in_shape, weights)
    x = rng.random((3, *in_shape))
    y = np.eye(classes)[rng.integers(0, classes, 3)]
    loss, grads, _ = net.loss_and_grads(x, y)
    assert float(loss) == pytest.approx(float(net.loss(x, y)), rel=1e-12)
    for i, (w, g) in enumerate(zip(net.weights, grads)):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, numeric_grad(lambda: float(net.loss(x, y)), w), rtol=1e-5, atol=1e-8,
                                   err_msg=f"weight {i} of {name}")


def test_dropout_gradient_with_a_fixed_mask() -> None:
    in_shape, net_layers = (6, 6, 1), layers(
        {"type": "conv2d", "filters": 2, "kernel_size": 3, "activation": "relu"},
        {"type": "dropout", "rate": 0.5},
        {"type": "flatten"},
        {"type": "dense", "units": 4, "activation": "tanh"},
        {"type": "dropout", "rate": 0.25},
        {"type": "dense", "units": 3, "activation": "softmax"})
    rng = np.random.default_rng(2)
    weights, _ = random_weights(net_layers, in_shape, rng)
    net = net_of(net_layers, in_shape, weights)
    x, y = rng.random((4, *in_shape)), np.eye(3)[[0, 1, 2, 0]]
    mask_rng = lambda: np.random.default_rng(7)  # noqa: E731  (the same masks on every call)
    _, grads, _ = net.loss_and_grads(x, y, rng=mask_rng())
    assert float(net.loss(x, y, rng=mask_rng())) != pytest.approx(float(net.loss(x, y)))  # masks do apply
    for w, g in zip(net.weights, grads):
        np.testing.assert_allclose(g, numeric_grad(lambda: float(net.loss(x, y, rng=mask_rng())), w),
                                   rtol=1e-5, atol=1e-8)


def test_dropout_is_inverted_and_off_in_inference() -> None:
    rng = np.random.default_rng(0)
    out, scale = ops.dropout(np.ones((200, 500)), 0.25, rng)
    np.testing.assert_allclose(np.unique(out), [0.0, 1 / 0.75])
    assert out.mean() == pytest.approx(1.0, abs=0.01)  # expectation preserved
    np.testing.assert_array_equal(out, scale)
    plain = layers({"type": "flatten"}, {"type": "dense", "units": 3, "activation": "softmax"})
    dropped = layers({"type": "flatten"}, {"type": "dropout", "rate": 0.5},
                     {"type": "dense", "units": 3, "activation": "softmax"})
    weights, _ = random_weights(plain, (4, 4, 1), rng)
    x = rng.random((5, 4, 4, 1))
    np.testing.assert_array_equal(net_of(dropped, (4, 4, 1), weights).forward(x),
                                  net_of(plain, (4, 4, 1), weights).forward(x))
    zero = layers({"type": "flatten"}, {"type": "dropout", "rate": 0.0}, {"type": "dense", "units": 3})
    y = np.eye(3)[[0, 1, 2, 0, 1]]
    net = net_of(zero, (4, 4, 1), weights)
    assert float(net.loss(x, y, rng=rng)) == float(net.loss(x, y))


def test_softmax_cross_entropy_is_stable_and_fused_gradient_is_p_minus_y() -> None:
    logits = np.array([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]])
    y = np.eye(3)[[1, 2]]
    mean, per_sample, probs = ops.softmax_cross_entropy(logits, y)
    np.testing.assert_allclose(per_sample, [1000.0, math.log(3)])
    assert float(mean) == pytest.approx((1000 + math.log(3)) / 2)
    net = net_of(layers({"type": "dense", "units": 3, "activation": "softmax"}), (3,), [np.eye(3), np.zeros(3)])
    _, grads, _ = net.loss_and_grads(logits, y)
    np.testing.assert_allclose(grads[1], (probs - y).sum(axis=0) / 2)


# --- optimizers ----------------------------------------------------------------------------------
GRADS = [0.5, -0.25, 1.0]


def run_optimizer(opt: Any, grads: Sequence[float], w0: float = 1.0) -> list[float]:
    w, out = np.array([w0]), []
    for g in grads:
        opt.step([w], [np.array([g])])
        out.append(float(w[0]))
    return out


def test_sgd_matches_hand_computation() -> None:
    assert run_optimizer(ops.SGD(0.1), GRADS) == pytest.approx([0.95, 0.975, 0.875])
    # v = 0.9 v - 0.1 g: v1 = -0.05, v2 = -0.045 + 0.025 = -0.02, v3 = -0.018 - 0.1 = -0.118
    assert run_optimizer(ops.SGD(0.1, momentum=0.9), GRADS) == pytest.approx([0.95, 0.93, 0.812])


def test_adam_matches_hand_computation() -> None:
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-7
    f32 = np.float32  # Keras computes the step size in the variables' dtype
    w, m, v, expected = 1.0, 0.0, 0.0, []
    for t, g in enumerate(GRADS, start=1):
        m, v = 0.1 * g + 0.9 * m, 0.001 * g * g + 0.999 * v
        step = float(f32(lr) * np.sqrt(f32(1) - f32(b2) ** f32(t)) / (f32(1) - f32(b1) ** f32(t)))
        w -= step * m / (math.sqrt(v) + eps)
        expected.append(w)
    assert expected[0] == pytest.approx(1.0 - 0.1, abs=1e-5)  # Adam's first step is ~lr * sign(g)
    assert run_optimizer(ops.Adam(lr), GRADS) == pytest.approx(expected, rel=1e-12)
    exact = lr * math.sqrt(1 - b2) / (1 - b1)
    assert ops.keras_adam_step_size(lr, b1, b2, 1) / exact == pytest.approx(1 - 6.4e-6, abs=1e-6)


def test_rmsprop_matches_hand_computation() -> None:
    # v1 = 0.1 * 0.25 = 0.025; epsilon sits inside the square root (Keras)
    w1 = 1.0 - 0.01 * 0.5 / math.sqrt(0.025 + 1e-7)
    v2 = 0.9 * 0.025 + 0.1 * 0.0625
    w2 = w1 + 0.01 * 0.25 / math.sqrt(v2 + 1e-7)
    assert run_optimizer(ops.RMSprop(0.01), GRADS[:2]) == pytest.approx([w1, w2], rel=1e-12)


@pytest.mark.tensorflow
@pytest.mark.parametrize("name", ["sgd", "sgd-momentum", "adam", "rmsprop"])
def test_optimizers_match_keras(name: str, keras: Any) -> None:
    ours = {"sgd": ops.SGD(0.05), "sgd-momentum": ops.SGD(0.05, 0.9), "adam": ops.Adam(0.01),
            "rmsprop": ops.RMSprop(0.01)}[name]
    theirs = {"sgd": lambda: keras.optimizers.SGD(0.05), "sgd-momentum": lambda: keras.optimizers.SGD(0.05, 0.9),
              "adam": lambda: keras.optimizers.Adam(0.01), "rmsprop": lambda: keras.optimizers.RMSprop(0.01)}[name]()
    rng = np.random.default_rng(3)
    w = rng.standard_normal(6).astype(np.float32)
    var = keras.Variable(w.copy())
    for _ in range(5):
        g = rng.standard_normal(6).astype(np.float32)
        ours.step([w], [g])
        theirs.apply_gradients([(keras.ops.convert_to_tensor(g), var)])
        np.testing.assert_allclose(w, var.numpy(), rtol=2e-6, atol=1e-7)


# --- the numpy backend ---------------------------------------------------------------------------
def mnist(limit: int = 512, **training: Any) -> wl_mod.Workload:
    wl = wl_mod.load("mnist").with_overrides(limit=limit)
    return wl.model_copy(update={"training": wl.training.model_copy(update=training)}) if training else wl


def arrays(wl: wl_mod.Workload) -> tuple[np.ndarray, ...]:
    from benchbackend.data import datasets as data

    ds = data.synthetic(wl)
    return (data.normalize(ds.x_train), ds.y_train, data.normalize(ds.x_val), ds.y_val,
            data.normalize(ds.x_test), ds.y_test)


def test_backend_trains_mnist_above_chance() -> None:
    from benchbackend.data.datasets import epoch_orders
    from benchbackend.run.worker import Repeat

    wl = mnist(512)
    backend = NumpyBackend(wl, "cpu", "reference")
    assert backend.build(initial_weights(wl)) == param_count(wl)
    x_train, y_train, x_val, y_val, x_test, y_test = arrays(wl)
    backend.set_data(x_train, y_train)
    cell = Repeat(backend, wl, {"x_val": x_val, "y_val": y_val, "x_test": x_test, "y_test": y_test}, lambda m: None)
    losses = []
    for order in epoch_orders(512, 4, wl.seed):
        (loss, acc), _ = cell.region(lambda: backend.train_epoch(order))
        loss, acc = float(loss), float(acc)
        assert 0 <= acc <= 1
        losses.append(loss)
    assert losses[-1] < losses[0]
    val_loss, val_acc = cell.evaluate("val")
    assert math.isfinite(val_loss)
    assert chance_accuracy(val_acc, len(y_val), wl.num_classes, alpha=0.01) is None
    scores, seconds = cell.predict()
    assert scores.shape == (wl.data.test, wl.num_classes) and isinstance(scores, np.ndarray) and seconds > 0
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, rtol=1e-5)
    assert cell.evaluate("test")[1] == pytest.approx(float(np.mean(scores.argmax(1) == y_test)))


def test_backend_contract_and_parity_with_the_float64_reference() -> None:
    wl = mnist(256)
    weights = initial_weights(wl)
    backend = NumpyBackend(wl, "cpu", "reference")
    backend.build(weights)
    copies = backend.get_weights()
    for a, b in zip(copies, weights):
        np.testing.assert_array_equal(a, b)
    copies[0][...] = 0  # copies, not views of the backend's weights
    weights[0][...] = 0  # and build() copied its input
    assert np.any(backend.get_weights()[0] != 0)
    weights = initial_weights(wl)
    assert backend.device_id() == "cpu" and backend.mode == "reference" and backend.gpu_name() == ""
    assert backend.version() == np.__version__ and NumpyBackend.probe()["devices"][0] == "cpu"
    x = arrays(wl)[2][:8]
    out = np.asarray(backend.to_host(backend.scores(backend.to_device(x), 8)), np.float64)
    ref = reference.forward(wl, weights, x.astype(np.float64))
    assert out.dtype == ref.dtype == np.float64 and out.shape == (8, 10)
    max_abs, max_rel = parity_errors(out, ref)
    assert max_rel < wl.checks.parity_rtol


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rmsprop"])
def test_train_steps_follow_the_float64_reference(optimizer: str) -> None:
    wl = mnist(256, optimizer=optimizer, lr=0.01 if optimizer == "sgd" else 0.001, momentum=0.0)
    weights = initial_weights(wl)
    x, y = arrays(wl)[:2]
    steps = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 160, 32)]
    ref = reference.train_losses(wl, weights, steps)
    assert all(isinstance(v, float) for v in ref) and ref[-1] < ref[0]
    np.testing.assert_array_equal(weights[0], initial_weights(wl)[0])  # inputs untouched
    # the first loss is that of the initial weights, before any update
    first = reference.forward(wl, weights, x[:32].astype(np.float64))
    assert ref[0] == pytest.approx(float(-np.log(first[np.arange(32), y[:32]]).mean()), rel=1e-12)
    backend = NumpyBackend(wl, "cpu", "reference")
    backend.build(weights)
    np.testing.assert_allclose(backend.train_steps(steps), ref, rtol=1e-4)


def test_train_losses_disable_dropout() -> None:
    wl = wl_mod.load("cifar10").with_overrides(limit=64)
    weights = initial_weights(wl)
    rng = np.random.default_rng(0)
    steps = [(rng.random((4, 32, 32, 3)), rng.integers(0, 10, 4)) for _ in range(2)]
    assert reference.train_losses(wl, weights, steps) == reference.train_losses(wl, weights, steps)


def test_devices() -> None:
    wl = mnist(64)
    with pytest.raises(BackendUnavailable, match="unknown device 'opencl'; use cpu, gpu"):
        NumpyBackend(wl, "opencl", "reference")
    if importlib.util.find_spec("cupy") is None:
        with pytest.raises(BackendUnavailable, match="CuPy.*not found"):
            NumpyBackend(wl, "gpu", "reference")
        assert NumpyBackend.probe()["devices"] == ["cpu"]


def test_fp64_precision_computes_in_float64() -> None:
    wl = mnist(64)
    weights = initial_weights(wl)
    backend = NumpyBackend(wl, "cpu", "reference", "fp64")
    backend.build(weights)
    x = arrays(wl)[2][:8]
    out = backend.to_host(backend.scores(backend.to_device(x), 8))
    assert out.dtype == np.float64
    max_abs, max_rel = parity_errors(out, reference.forward(wl, weights, x.astype(np.float64)))
    assert max_rel < wl.checks.tolerance("fp64").rtol  # 1e-9: only float64 all the way through passes


def test_library_modules_import_no_framework() -> None:
    import subprocess
    import sys

    code = ("import sys, benchbackend.backends.numpy.reference as r, benchbackend.backends.numpy.ops; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'cupy') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


# --- property-based parity with PyTorch and TensorFlow -------------------------------------------
@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'benchbackend[torch]')")


@pytest.fixture(scope="module")
def tf() -> Any:
    return pytest.importorskip("tensorflow",
                               reason="TensorFlow is not installed (pip install 'benchbackend[tensorflow]')")


@pytest.fixture(scope="module")
def keras(tf: Any) -> Any:
    import keras

    return keras


@st.composite
def conv_cases(draw: Any) -> dict[str, Any]:
    return dict(k=draw(st.integers(1, 5)), stride=draw(st.integers(1, 2)),
                padding=draw(st.sampled_from(["same", "valid"])), c_in=draw(st.integers(1, 8)),
                filters=draw(st.integers(1, 8)), h=draw(st.integers(5, 12)), w=draw(st.integers(5, 12)),
                n=draw(st.integers(1, 3)), activation=draw(st.sampled_from(ACTIVATIONS)),
                seed=draw(st.integers(0, 2**32 - 1)))


@st.composite
def pool_cases(draw: Any) -> dict[str, Any]:
    return dict(pool=draw(st.integers(1, 3)), stride=draw(st.sampled_from([None, 1, 2, 3])),
                c=draw(st.integers(1, 8)), h=draw(st.integers(5, 12)), w=draw(st.integers(5, 12)),
                n=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**32 - 1)))


def conv_net(case: dict[str, Any]) -> tuple[Network, np.ndarray]:
    layer = Conv2D(type="conv2d", filters=case["filters"], kernel_size=case["k"], stride=case["stride"],
                   padding=case["padding"], activation=case["activation"])
    rng = np.random.default_rng(case["seed"])
    shape = (case["h"], case["w"], case["c_in"])
    weights, _ = random_weights([layer], shape, rng)
    return net_of([layer], shape, weights), rng.standard_normal((case["n"], *shape))


def torch_act(torch: Any, z: Any, fn: str) -> Any:
    return {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
            "softmax": lambda t: torch.softmax(t, dim=1), "none": lambda t: t}[fn](z)


def tf_act(tf: Any, z: Any, fn: str) -> Any:
    return {"relu": tf.nn.relu, "tanh": tf.tanh, "sigmoid": tf.sigmoid, "softmax": tf.nn.softmax,
            "none": lambda t: t}[fn](z)


def f64(tf: Any, a: np.ndarray) -> Any:
    """An explicit float64 tensor: TF 2.21 has run later tf.nn.max_pool2d calls on float64 NumPy
    inputs in float32 (its eager cache of the first call's conversion), losing the tight tolerance."""
    return tf.constant(a, tf.float64)


def oihw(torch: Any, w: np.ndarray) -> Any:
    """HWIO -> a contiguous OIHW tensor (a permuted view as a leaf breaks torch's conv backward)."""
    return torch.from_numpy(w.transpose(3, 2, 0, 1).copy())


def torch_conv(torch: Any, x: Any, w: Any, b: Any, stride: int, padding: str) -> Any:
    """NCHW x OIHW conv with TF 'same' padding done by hand (torch's padding='same' is symmetric)."""
    F = torch.nn.functional
    if padding == "same":
        k = w.shape[2]
        (pt, pb), (pl, pr) = same_pads(x.shape[2], k, stride), same_pads(x.shape[3], k, stride)
        x = F.pad(x, (pl, pr, pt, pb))
    return F.conv2d(x, w, b, stride=stride)


@pytest.mark.torch
@PROPERTY
@given(case=conv_cases())
def test_conv_forward_matches_torch(torch: Any, case: dict[str, Any]) -> None:
    net, x = conv_net(case)
    w, b = net.weights
    z = torch_conv(torch, torch.from_numpy(x).permute(0, 3, 1, 2), oihw(torch, w), torch.from_numpy(b),
                   case["stride"], case["padding"])
    expected = torch_act(torch, z, case["activation"]).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(net.forward(x), expected, **TIGHT)


@pytest.mark.tensorflow
@PROPERTY
@given(case=conv_cases())
def test_conv_forward_matches_tensorflow(tf: Any, case: dict[str, Any]) -> None:
    net, x = conv_net(case)
    w, b = net.weights
    z = tf.nn.conv2d(f64(tf, x), f64(tf, w), strides=case["stride"], padding=case["padding"].upper()) + f64(tf, b)
    np.testing.assert_allclose(net.forward(x), tf_act(tf, z, case["activation"]).numpy(), **TIGHT)


@pytest.mark.torch
@PROPERTY
@given(case=conv_cases())
def test_conv_backward_matches_torch_autograd(torch: Any, case: dict[str, Any]) -> None:
    net, x = conv_net(case)
    w, b = net.weights
    out, cache = ops.conv2d(x, w, b, case["stride"], case["padding"])
    g = np.random.default_rng(case["seed"] + 1).standard_normal(out.shape)
    dx, dw, db = ops.conv2d_backward(g, cache)
    xt = torch.from_numpy(x).permute(0, 3, 1, 2).requires_grad_()
    wt, bt = oihw(torch, w).requires_grad_(), torch.from_numpy(b).requires_grad_()
    z = torch_conv(torch, xt, wt, bt, case["stride"], case["padding"])
    z.backward(torch.from_numpy(g).permute(0, 3, 1, 2))
    np.testing.assert_allclose(dx, xt.grad.permute(0, 2, 3, 1).numpy(), **TIGHT)
    np.testing.assert_allclose(dw, wt.grad.permute(2, 3, 1, 0).numpy(), **TIGHT)
    np.testing.assert_allclose(db, bt.grad.numpy(), **TIGHT)


@pytest.mark.torch
@PROPERTY
@given(case=pool_cases())
def test_maxpool_forward_and_backward_match_torch(torch: Any, case: dict[str, Any]) -> None:
    rng = np.random.default_rng(case["seed"])
    x = rng.standard_normal((case["n"], case["h"], case["w"], case["c"]))
    stride = case["stride"] or case["pool"]
    out, cache = ops.maxpool2d(x, case["pool"], stride)
    g = rng.standard_normal(out.shape)
    xt = torch.from_numpy(x).permute(0, 3, 1, 2).requires_grad_()
    expected = torch.nn.functional.max_pool2d(xt, case["pool"], stride)
    expected.backward(torch.from_numpy(g).permute(0, 3, 1, 2))
    np.testing.assert_array_equal(out, expected.detach().permute(0, 2, 3, 1).numpy())
    np.testing.assert_allclose(ops.maxpool2d_backward(g, cache), xt.grad.permute(0, 2, 3, 1).numpy(), **TIGHT)


@pytest.mark.tensorflow
@PROPERTY
@given(case=pool_cases())
def test_maxpool_forward_matches_tensorflow(tf: Any, case: dict[str, Any]) -> None:
    x = np.random.default_rng(case["seed"]).standard_normal((case["n"], case["h"], case["w"], case["c"]))
    layer = MaxPool2D(type="maxpool2d", pool_size=case["pool"], stride=case["stride"])
    expected = tf.nn.max_pool2d(f64(tf, x), case["pool"], case["stride"] or case["pool"], "VALID").numpy()
    np.testing.assert_array_equal(net_of([layer], x.shape[1:], []).forward(x), expected)


@st.composite
def dense_cases(draw: Any) -> dict[str, Any]:
    return dict(n=draw(st.integers(1, 5)), d_in=draw(st.integers(1, 40)), units=draw(st.integers(1, 10)),
                activation=draw(st.sampled_from(ACTIVATIONS)), seed=draw(st.integers(0, 2**32 - 1)))


@pytest.mark.torch
@pytest.mark.tensorflow
@PROPERTY
@given(case=dense_cases())
def test_dense_forward_matches_torch_and_tensorflow(torch: Any, tf: Any, case: dict[str, Any]) -> None:
    layer = Dense(type="dense", units=case["units"], activation=case["activation"])
    rng = np.random.default_rng(case["seed"])
    (w, b), _ = random_weights([layer], (case["d_in"],), rng)
    x = rng.standard_normal((case["n"], case["d_in"]))
    ours = net_of([layer], (case["d_in"],), [w, b]).forward(x)
    z = torch.nn.functional.linear(torch.from_numpy(x), torch.from_numpy(w.T.copy()), torch.from_numpy(b))
    np.testing.assert_allclose(ours, torch_act(torch, z, case["activation"]).numpy(), **TIGHT)
    z = tf.matmul(f64(tf, x), f64(tf, w)) + f64(tf, b)
    np.testing.assert_allclose(ours, tf_act(tf, z, case["activation"]).numpy(), **TIGHT)


@pytest.mark.torch
@PROPERTY
@given(conv=conv_cases(), pool=st.integers(1, 2), units=st.integers(2, 6))
def test_network_forward_matches_torch_with_nchw_flatten(torch: Any, conv: dict[str, Any], pool: int,
                                                         units: int) -> None:
    """conv -> maxpool -> flatten -> dense softmax: the dense rows are permuted for NCHW flatten."""
    net_layers = layers(
        {"type": "conv2d", "filters": conv["filters"], "kernel_size": conv["k"], "stride": conv["stride"],
         "padding": conv["padding"], "activation": conv["activation"]},
        {"type": "maxpool2d", "pool_size": pool}, {"type": "flatten"},
        {"type": "dense", "units": units, "activation": "softmax"})
    in_shape = (conv["h"], conv["w"], conv["c_in"])
    assume(min(conv_out(n, conv["k"], conv["stride"], conv["padding"]) for n in in_shape[:2]) >= pool)
    rng = np.random.default_rng(conv["seed"])
    weights, _ = random_weights(net_layers, in_shape, rng)
    x = rng.standard_normal((conv["n"], *in_shape))
    z = torch_conv(torch, torch.from_numpy(x).permute(0, 3, 1, 2), oihw(torch, weights[0]),
                   torch.from_numpy(weights[1]), conv["stride"], conv["padding"])
    z = torch.nn.functional.max_pool2d(torch_act(torch, z, conv["activation"]), pool)
    rows = nhwc_to_nchw_rows(z.shape[2], z.shape[3], z.shape[1])
    logits = torch.flatten(z, 1) @ torch.from_numpy(weights[2][rows]) + torch.from_numpy(weights[3])
    np.testing.assert_allclose(net_of(net_layers, in_shape, weights).forward(x), torch.softmax(logits, 1).numpy(),
                               **TIGHT)


def test_the_reference_trajectory_is_computed_once_and_kept(tmp_path, monkeypatch) -> None:
    """The float64 trajectory every backend of a definition is compared with is cached on disk,
    keyed by what it depends on: the same inputs come back from the cache, other weights do not."""
    from benchbackend.run import truth

    monkeypatch.setenv("BENCHBACKEND_CACHE", str(tmp_path))
    wl = wl_mod.load("mnist").with_overrides(limit=64)
    weights = initial_weights(wl, 1)
    rng = np.random.default_rng(0)
    steps = [(rng.random((8, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, 8)) for _ in range(3)]
    computed = []
    real = reference.train_losses
    monkeypatch.setattr(reference, "train_losses", lambda *a, **k: computed.append(1) or real(*a, **k))
    first = truth.trajectory(wl, weights, steps)
    assert first == real(wl, weights, steps) and computed == [1]
    assert truth.trajectory(wl, weights, steps) == first and computed == [1]  # from the cache
    other = initial_weights(wl, 2)
    assert truth.trajectory(wl, other, steps) != first and computed == [1, 1]
    assert len(list((tmp_path / "reference").glob("*.json"))) == 2
