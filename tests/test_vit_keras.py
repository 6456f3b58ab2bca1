"""The Keras 3 ViT layers (``backends/keras_transformer.py``) and PlaidML's answer.

Each Keras default the issue names, planted in the builder that tensorflow, keras-jax and
keras-torch share (Keras' layernorm epsilon 1e-3, ``keras.ops.gelu``'s tanh form, an unscaled
attention, the q/k/v columns read dim-major), moves the trap network's forward output past its
parity tolerance on tensorflow (in this process); ``test_vit_backends.py`` shows the unplanted
builder within it on all three. Beside them: the canonical weights go in and come back unchanged,
weight decay (decoupled and L2) reaches the kernels only, XLA and bf16 cells pass their checks.
"""
from __future__ import annotations

import numpy as np
import pytest
from support.vit import PARITY_RTOL, trap

from benchbackend.backends.registry import BACKENDS
from benchbackend.spec import model
from conftest import requires, run_cell

pytestmark = requires("tensorflow")


def forward_error(tmp_path, **fields) -> float:
    """The trap's forward-parity error (inference mode) on tensorflow, in this process."""
    rows = run_cell(tmp_path, trap(), "tensorflow", parity_steps=0, **fields)[1]
    return next(r for r in rows if r["phase"] == "parity" and not r.get("steps"))["parity_max_rel"]


def _keras_epsilon(monkeypatch):
    import keras

    layernorm = keras.layers.LayerNormalization
    monkeypatch.setattr(keras.layers, "LayerNormalization",
                        lambda axis=-1, epsilon=None, **kw: layernorm(axis=axis, **kw))  # Keras' 1e-3


def _ops_gelu(monkeypatch):
    from benchbackend.backends.keras import transformer as keras_transformer

    monkeypatch.setattr(keras_transformer, "gelu", lambda keras, approximate: keras.ops.gelu)  # tanh form


def _unscaled(monkeypatch):
    import keras

    from benchbackend.backends.keras import transformer as keras_transformer

    cls = keras_transformer._classes(keras).Attention
    init = cls.__init__

    def unscaled(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._inverse_sqrt_key_dim = 1.0
    monkeypatch.setattr(cls, "__init__", unscaled)


def _dim_major(monkeypatch):
    from benchbackend.backends.keras import transformer as keras_transformer

    def dim_major(arrays, heads, head_dim):  # q/k/v columns read as (head_dim, heads)
        return [np.swapaxes(np.asarray(a).reshape(*a.shape[:-1], head_dim, heads), -1, -2) if j < 6 else
                np.asarray(a).reshape(heads, head_dim, -1) if j == 6 else np.asarray(a)
                for j, a in enumerate(arrays)]
    monkeypatch.setattr(keras_transformer, "attention_to_keras", dim_major)


PLANTED = {"Keras' layernorm epsilon": _keras_epsilon, "keras.ops.gelu": _ops_gelu, "unscaled attention": _unscaled,
           "dim-major q/k/v": _dim_major}


@pytest.mark.parametrize("planted", list(PLANTED))
def test_the_trap_fails_when_the_keras_builder_keeps_a_keras_default(tmp_path, monkeypatch, planted):
    PLANTED[planted](monkeypatch)
    assert forward_error(tmp_path) > 10 * PARITY_RTOL, planted


def test_the_trap_agrees_under_xla(tmp_path):
    assert forward_error(tmp_path, mode="xla") < PARITY_RTOL


def test_bf16_keeps_layernorm_in_float32_and_passes_its_checks(tmp_path):
    import keras

    from benchbackend.backends.tensorflow.adapter import TensorFlowBackend

    net = TensorFlowBackend(trap(), "cpu", precision="bf16")._net()
    norms = [layer for layer in net.holders if isinstance(layer, keras.layers.LayerNormalization)]
    # Keras' policy: bf16 in and out, float32 variables, normalized in float32 (ops.layer_normalization)
    assert norms and all(n.compute_dtype == "bfloat16" and n.variable_dtype == "float32" for n in norms)
    rows = run_cell(tmp_path, trap(), "tensorflow", precision="bf16", parity_steps=2)[1]
    tol = trap().checks.tolerance("bf16")
    for r in (r for r in rows if r["phase"] == "parity" and not r.get("steps")):
        assert r["parity_max_rel"] < tol.rtol or r["parity_max_abs"] < tol.atol, r
    assert next(r for r in rows if r.get("steps"))["parity_step"] is None


def _net(w):
    import keras

    from benchbackend.backends.keras.layers import keras3_build

    net = keras3_build(w, keras)
    net.set(model.initial_weights(w))
    return net


def test_the_canonical_weights_go_in_and_come_back_unchanged():
    w = trap(heads=3, head_dim=4)  # 12 columns on a width of 6: heads * head_dim need not be d
    got = _net(w).get()
    want = model.initial_weights(w)
    assert [g.shape for g in got] == [x.shape for x in want]
    for g, x in zip(got, want):
        np.testing.assert_array_equal(g, x)


def test_decoupled_weight_decay_reaches_the_kernels_only():
    """Adam with zero gradients moves a weight by its decay alone: the kernels (conv, dense and the
    attention's four) shrink; biases, norms, the class token and the position embedding stay."""
    import keras

    from benchbackend.backends.keras.layers import keras3_optimizer

    w = trap(weight_decay={"kind": "decoupled", "rate": 0.1})
    net = _net(w)
    before = net.get()
    variables = net.model.trainable_variables
    opt = keras3_optimizer(keras, w, net)
    opt.apply_gradients([(np.zeros(v.shape, np.float32), v) for v in variables])
    moved = [not np.array_equal(a, b) for a, b in zip(before, net.get())]
    kernels = model.kernel_mask(net.graph)
    assert moved == [k and np.any(a != 0) for k, a in zip(kernels, before)]
    assert sum(kernels) == 1 + 2 * (4 + 2) + 1  # patch conv, per block 4 attention + 2 dense, the head


def test_l2_weight_decay_regularizes_the_kernels_only():
    w = trap(weight_decay={"kind": "l2", "rate": 0.1})
    net = _net(w)
    kernels = [a for a, k in zip(net.get(), model.kernel_mask(net.graph)) if k]
    assert float(sum(net.model.losses)) == pytest.approx(0.1 * sum(float((a ** 2).sum()) for a in kernels), rel=1e-5)


def test_plaidml_says_why_it_builds_no_vit():
    why = BACKENDS["plaidml"].cannot_build(model.vocabulary(trap()))
    assert "erf" in why and "gelu" in why
