"""Vision Transformer layers on every backend: each framework default the issue names (GELU's tanh
form, a framework's own layernorm epsilon, an unscaled or dim-major attention) is a forward-parity
failure on ``support.vit.trap``, and the shipped vit-tiny, tiny, runs on every backend.

The first tests show, on the NumPy reference itself, that each trap moves the trap network's output
far past its parity tolerance: an adapter that kept the default fails ``test_the_trap_network_agrees
_with_the_reference``. Each adapter's own test file plants its defaults and sees that test's check
fail (``test_vit_torch.py``, ``test_vit_keras.py``, ...).
"""
from __future__ import annotations

import numpy as np
import pytest
from support.vit import PARITY_RTOL, trap, vit_tiny_smoke

from benchbackend.backends.numpy import transformer as tr
from benchbackend.backends.numpy.reference import forward
from benchbackend.backends.registry import BACKENDS
from benchbackend.run import checks
from benchbackend.spec import model
from conftest import INFERENCE, TRAINING, any_cell, backend_params

VIT_WORDS = model.vocabulary(trap())


def builders(names: list[str]) -> list[str]:
    return [n for n in names if not BACKENDS[n].cannot_build(VIT_WORDS)]


X = np.random.default_rng(0).uniform(0, 1, (8, 4, 4, 2))
WEIGHTS = model.initial_weights(trap())
REFERENCE = forward(trap(), WEIGHTS, X)


def _reference_error(other_forward) -> float:
    """The trap's parity error of ``other_forward(workload, weights, x)`` against the reference."""
    return checks.parity_errors(other_forward(trap(), WEIGHTS, X), REFERENCE)[1]


@pytest.mark.parametrize("epsilon", [1e-5, 1e-3, 1e-6])  # torch, Keras, flax
def test_a_framework_epsilon_misses_the_trap_by_far(epsilon: float) -> None:
    err = _reference_error(lambda w, weights, x: forward(trap(epsilon=epsilon), weights, x))
    assert err > 1000 * PARITY_RTOL


def test_the_tanh_gelu_misses_the_trap() -> None:
    err = _reference_error(lambda w, weights, x: forward(trap(approximate=True), weights, x))
    assert err > 10 * PARITY_RTOL  # measured 4.4e-5
    assert _reference_error(lambda w, weights, x: forward(w, weights, x, dtype=np.float32)) < PARITY_RTOL / 10


@pytest.mark.parametrize("planted", ["unscaled", "dim-major"])
def test_a_misread_attention_misses_the_trap(monkeypatch: pytest.MonkeyPatch, planted: str) -> None:
    attention = tr.attention

    def wrong(x, w, layer):
        heads, head_dim = layer.heads, layer.head_dim
        if planted == "unscaled":  # scores not divided by sqrt(head_dim): scale q by it
            w = [w[0] * np.sqrt(head_dim), w[1] * np.sqrt(head_dim), *w[2:]]
        else:  # the q/k/v columns read (head_dim, heads) instead of (heads, head_dim)
            def t(a):
                return a.reshape(*a.shape[:-1], head_dim, heads).swapaxes(-1, -2).reshape(a.shape)
            w = [t(a) if i < 6 else a for i, a in enumerate(w)]
        return attention(x, w, layer)

    monkeypatch.setattr(tr, "attention", wrong)
    err = _reference_error(lambda w, weights, x: forward(w, weights, x))
    assert err > 100 * PARITY_RTOL


def _parity(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["phase"] == "parity" and not r.get("steps")]


@pytest.mark.parametrize("backend", backend_params(builders(TRAINING + INFERENCE), build_isolated=True))
def test_the_trap_network_agrees_with_the_reference(tmp_path, envs_root, backend: str) -> None:
    w = trap()
    trains = BACKENDS[backend].trains
    rows = any_cell(tmp_path, w, backend, envs_root, parity_steps=3 if trains else 0)
    for r in _parity(rows):
        assert r["parity_max_rel"] < PARITY_RTOL, r
    if trains:
        traj = next(r for r in rows if r.get("steps"))
        assert traj["parity_step"] is None, traj["notes"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(builders(TRAINING + INFERENCE), build_isolated=True))
def test_vit_tiny_smoke(tmp_path, envs_root, backend: str) -> None:
    w = vit_tiny_smoke()
    trains = BACKENDS[backend].trains
    rows = any_cell(tmp_path, w, backend, envs_root, parity_steps=2 if trains else 0)
    phases = [r["phase"] for r in rows]
    assert phases.count("train_epoch") == (1 if trains else 0) and "inference" in phases, phases
    for r in _parity(rows):
        assert r["parity_max_rel"] < w.checks.parity_rtol, r
    if trains:
        assert next(r for r in rows if r.get("steps"))["parity_step"] is None


def test_every_backend_builds_a_vit_or_says_why_its_framework_cannot() -> None:
    for name, spec in BACKENDS.items():
        why = spec.cannot_build(VIT_WORDS)
        assert why == "" or spec.builds_note, f"{name}: {why}"
