"""The NumPy reference's new layers and training rules, in-process on tiny shapes: batchnorm (batch
statistics, moving statistics with Keras' momentum and the biased variance), residual adds with
fan-out, global average pooling, explicit and asymmetric padding (max-pool pads never win),
convolutions without bias, the L2 penalty, decoupled weight decay and Nesterov's SGD."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pytest
from pydantic import TypeAdapter

from benchbackend.backends.numpy import ops
from benchbackend.backends.numpy.reference import Network, train_step
from benchbackend.spec import graph as graph_mod
from benchbackend.spec.workload import Layer, TrainingSpec
from conftest import numeric_grad


def layers(*specs: dict) -> list[Any]:
    return TypeAdapter(list[Layer]).validate_python(list(specs))


def net_of(specs: Sequence[dict], in_shape: tuple[int, ...], seed: int = 0, l2: float = 0.0) -> Network:
    """A float64 network with random weights (batchnorm: positive variances, gamma around 1)."""
    g = graph_mod.resolve_layers(layers(*specs), in_shape)
    rng = np.random.default_rng(seed)
    weights = []
    for node in g.nodes:
        for j, shape in enumerate(node.weights):
            if node.kind == "batchnorm":
                weights.append([1 + 0.3 * rng.standard_normal(shape), 0.2 * rng.standard_normal(shape),
                                0.1 * rng.standard_normal(shape), rng.uniform(0.5, 2.0, shape)][j])
            else:
                weights.append(rng.standard_normal(shape) * (0.5 if node.kernel[j] else 0.1))
    return Network(g, weights, l2)



def check_gradients(net: Network, x: np.ndarray, classes: int, check_input: bool = False) -> None:
    rng = np.random.default_rng(3)
    y = np.eye(classes)[rng.integers(0, classes, len(x))]
    moving = [w.copy() for w in net.weights]
    loss, grads, _ = net.loss_and_grads(x, y)
    before_update = net.loss(x, y)
    assert float(loss) == pytest.approx(float(before_update), rel=1e-12)
    for w, saved in zip(net.weights, moving):  # the numeric gradient must see the same moving statistics
        w[...] = saved
    for i, (w, g) in enumerate(zip(net.params(), grads)):
        np.testing.assert_allclose(g, numeric_grad(lambda: float(net.loss(x, y)), w), rtol=1e-5, atol=1e-8,
                                   err_msg=f"trainable array {i}")


RESIDUAL = [
    {"type": "conv2d", "name": "stem", "filters": 3, "kernel_size": 3, "padding": 1, "use_bias": False},
    {"type": "batchnorm", "activation": "relu", "momentum": 0.9, "epsilon": 1e-3},
    {"type": "conv2d", "filters": 3, "kernel_size": 3, "stride": 2, "padding": "same"},
    {"type": "batchnorm", "name": "main"},
    {"type": "conv2d", "name": "proj", "inputs": ["stem"], "filters": 3, "kernel_size": 1, "stride": 2,
     "padding": "same", "use_bias": False},
    {"type": "add", "inputs": ["main", "proj"], "activation": "relu"},
    {"type": "maxpool2d", "pool_size": 2, "stride": 1, "padding": [[0, 1], [1, 0]]},
    {"type": "global_avgpool"},
    {"type": "dense", "units": 4, "activation": "softmax"},
]


def test_residual_graph_gradients_match_finite_differences():
    net = net_of(RESIDUAL, (6, 7, 2), l2=1e-2)
    check_gradients(net, np.random.default_rng(0).standard_normal((3, 6, 7, 2)), 4)


def test_batchnorm_on_flat_features_and_three_way_add():
    net = net_of([{"type": "flatten", "name": "f"}, {"type": "dense", "units": 5, "name": "a"},
                  {"type": "batchnorm", "name": "b", "activation": "tanh"},
                  {"type": "add", "inputs": ["a", "b", "b"]},
                  {"type": "dense", "units": 3, "activation": "softmax"}], (2, 2, 1), seed=1)
    check_gradients(net, np.random.default_rng(1).standard_normal((4, 2, 2, 1)), 3)


def test_batchnorm_training_uses_batch_statistics_and_updates_the_moving_ones_keras_style():
    net = net_of([{"type": "batchnorm", "momentum": 0.9, "epsilon": 0.01},
                  {"type": "flatten"}, {"type": "dense", "units": 2, "activation": "softmax"}], (2, 2, 3))
    gamma, beta, mm, mv = (w.copy() for w in net.weights[:4])
    x = np.random.default_rng(0).standard_normal((2, 2, 2, 3)) * 3 + 1
    out, *_ = ops.batchnorm_train(x, gamma, beta, 0.01)
    mean, var = x.mean(axis=(0, 1, 2)), x.var(axis=(0, 1, 2))  # biased: divided by the count, 8
    np.testing.assert_allclose(out, (x - mean) / np.sqrt(var + 0.01) * gamma + beta, rtol=1e-12)
    net.loss_and_grads(x, np.eye(2)[[0, 1]])
    np.testing.assert_allclose(net.weights[2], 0.9 * mm + 0.1 * mean, rtol=1e-12)
    np.testing.assert_allclose(net.weights[3], 0.9 * mv + 0.1 * var, rtol=1e-12)
    # inference reads the moving statistics; training mode (forward(training=True)) does not update them
    saved = net.weights[2].copy()
    infer = ops.batchnorm_infer(x, gamma, beta, net.weights[2], net.weights[3], 0.01)
    assert not np.allclose(infer, out)
    net.forward(x, training=True)
    np.testing.assert_array_equal(net.weights[2], saved)


def test_maxpool_padding_never_wins_a_max():
    x = -np.ones((1, 2, 2, 1)) * np.arange(1, 5).reshape(1, 2, 2, 1)  # all negative
    out, cache = ops.maxpool2d(x, 2, 1, ((1, 1), (1, 1)))
    assert out.max() < 0  # a zero pad would have won every window
    np.testing.assert_array_equal(out[0, :, :, 0], [[-1, -1, -2], [-1, -1, -2], [-3, -3, -4]])
    g = ops.maxpool2d_backward(np.ones_like(out), cache)
    assert g.shape == x.shape and g.sum() == out.size  # every gradient lands on a real pixel


def test_conv_padding_forms_agree():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((1, 5, 5, 2)), rng.standard_normal((3, 3, 2, 4))
    same, _ = ops.conv2d(x, w, None, 2, "same")
    explicit, _ = ops.conv2d(x, w, None, 2, ((1, 1), (1, 1)))  # 5 at stride 2: TF pads (1, 1)
    np.testing.assert_allclose(same, explicit)
    as_int, _ = ops.conv2d(x, w, None, 1, 1)
    np.testing.assert_allclose(as_int, ops.conv2d(x, w, None, 1, "same")[0])
    asym = graph_mod.resolve_pads("same", 6, 6, 3, 2)
    assert asym == ((0, 1), (0, 1))  # TensorFlow: the odd pixel after


def test_l2_penalty_is_keras_kernel_regularizer_on_kernels_only():
    net = net_of(RESIDUAL, (6, 7, 2), l2=0.5)
    plain = Network(net.graph, net.weights, 0.0)
    x, y = np.random.default_rng(0).standard_normal((2, 6, 7, 2)), np.eye(4)[[0, 3]]
    kernels = [w for w, k in zip(net.weights, net.kernels) if k]
    assert len(kernels) == 4  # three convs and the dense: not biases, not batchnorm
    assert float(net.loss(x, y)) == pytest.approx(float(plain.loss(x, y)) + 0.5 * sum((k ** 2).sum() for k in kernels))


def test_decoupled_weight_decay_scales_kernels_before_the_update():
    net = net_of(RESIDUAL, (6, 7, 2))
    spec = TrainingSpec(optimizer="sgd", lr=0.1, batch_size=2, epochs=1,
                        weight_decay={"kind": "decoupled", "rate": 0.5})
    x, y = np.random.default_rng(0).standard_normal((2, 6, 7, 2)), np.eye(4)[[0, 3]]
    before = [w.copy() for w in net.weights]
    _, grads, _ = Network(net.graph, [w.copy() for w in before]).loss_and_grads(x, y)
    train_step(net, ops.make_optimizer(spec), x, y, spec)
    trainable = [i for i, t in enumerate(net.trainable) if t]
    for i, g in zip(trainable, grads):
        decay = 1 - 0.1 * 0.5 if net.kernels[i] else 1.0
        np.testing.assert_allclose(net.weights[i], before[i] * decay - 0.1 * g, rtol=1e-12)


def test_nesterov_sgd_is_keras_formula():
    opt = ops.SGD(0.1, 0.9, nesterov=True)
    w, v = np.array([1.0]), 0.0
    expected = 1.0
    for g in (0.5, -0.25, 1.0):
        opt.step([w], [np.array([g])])
        v = 0.9 * v - 0.1 * g
        expected += 0.9 * v - 0.1 * g
        assert w[0] == pytest.approx(expected, rel=1e-14)
    with pytest.raises(ValueError, match="nesterov"):
        TrainingSpec(optimizer="adam", lr=0.1, batch_size=2, epochs=1, nesterov=True)
