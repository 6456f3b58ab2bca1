"""Each adapter's own optimizer step against the reference's Keras rules, on made-up gradients.

The 20-step loss trajectory (--parity-steps) cannot see an epsilon in the wrong place on a
chaotic workload: Adam on a ReLU/max-pool network turns 1e-7 differences into 1e-2 within 20
steps (see checks.trajectory). Here nothing is chaotic: the same parameters get the same
gradients, with magnitudes from 1e-9 (where epsilon decides the step) to 1e-1, for 30 steps, and
the parameters must agree to float32 rounding. Stock torch.optim.Adam, whose epsilon sits after
the bias correction, is the control that must fail."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from benchbackend.backends.numpy import ops
from benchbackend.spec import model, workload

STEPS = 30


def gradients(shape: tuple[int, ...], seed: int) -> list[np.ndarray]:
    """Per step: random signs, magnitudes log-uniform over 1e-9..1e-1, a few exact zeros."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        g = rng.choice([-1.0, 1.0], shape) * 10.0 ** rng.uniform(-9, -1, shape)
        g[rng.random(shape) < 0.05] = 0.0
        out.append(g.astype(np.float32))
    return out


def reference_params(opt: ops.Optimizer, p0: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    p = p0.astype(np.float32).copy()
    for g in grads:
        opt.step([p], [g])
    return p


def close(ours: np.ndarray, theirs: np.ndarray, lr: float) -> float:
    """Largest difference, in units of the learning rate (Adam moves a parameter ~lr per step)."""
    return float(np.max(np.abs(ours - theirs)) / lr)


def spec(optimizer: str, lr: float, momentum: float = 0.0) -> workload.Workload:
    w = workload.load("mnist")
    return w.model_copy(update={"training": w.training.model_copy(update={"optimizer": optimizer, "lr": lr,
                                                                         "momentum": momentum})})


CASES = [("adam", 1e-3, 0.0), ("sgd", 0.05, 0.9), ("sgd", 0.05, 0.0)]


def torch_steps(w: workload.Workload):
    """The torch adapter built for ``w`` takes ``STEPS`` steps of its own (``_backward_step``, the one
    step ``train_epoch`` and ``train_steps`` take: decay, the Keras-Adam correction, ``opt.step``) on
    made-up gradients of its first conv kernel (OIHW): (that parameter, its initial value, the gradients).
    The loss ``sum(p * g)`` has gradient ``g`` in ``p`` and none elsewhere (torch skips those)."""
    import torch

    from benchbackend.backends.torch.adapter import TorchBackend

    b = TorchBackend(w, "cpu", "eager", "fp32", {})
    b.build(model.initial_weights(w))
    p = b.opt.param_groups[0]["params"][0]
    p0 = p.detach().numpy().copy()
    grads = gradients(p.shape, 0)
    for g in grads:
        b._backward_step((p * torch.from_numpy(g)).sum())
    return p, p0, grads


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed")
@pytest.mark.parametrize("optimizer,lr,momentum", CASES)
def test_the_torch_adapter_steps_as_keras(optimizer, lr, momentum):
    w = spec(optimizer, lr, momentum)
    p, p0, grads = torch_steps(w)
    want = reference_params(ops.make_optimizer(w.training), p0, grads)
    # Adam measured 3e-5 (one float32 ulp of these weights); without the correction, 2.8.
    assert close(p.detach().numpy(), want, lr) < 1e-3


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed")
def test_stock_torch_adam_fails_the_same_comparison():
    import torch

    p0 = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.Adam([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-7)  # epsilon after bias correction
    grads = gradients(p0.shape, 0)
    for g in grads:
        p.grad = torch.from_numpy(g)
        opt.step()
    want = reference_params(ops.Adam(1e-3), p0, grads)
    assert close(p.detach().numpy(), want, 1e-3) > 1.0  # whole steps apart where |g| ~ epsilon


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="JAX is not installed")
@pytest.mark.parametrize("optimizer,lr,momentum", CASES)
def test_the_jax_adapter_steps_as_keras(optimizer, lr, momentum):
    import jax
    import jax.numpy as jnp

    from benchbackend.backends.jax import adapter as jb

    p0 = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    grads = gradients(p0.shape, 0)
    step = jax.jit(lambda p, g, s: jb._update(optimizer, lr, momentum, p, g, s))
    params, state = [jnp.asarray(p0)], jb._init_state(optimizer, momentum, [jnp.asarray(p0)])
    for g in grads:
        params, state = step(params, [jnp.asarray(g)], state)
    want = reference_params(ops.make_optimizer(spec(optimizer, lr, momentum).training), p0, grads)
    assert close(np.asarray(params[0]), want, lr) < 1e-3


def nesterov_spec(lr: float = 0.05, momentum: float = 0.9, decay: dict | None = None) -> workload.Workload:
    w = workload.load("mnist")
    return w.model_copy(update={"training": w.training.model_copy(update={
        "optimizer": "sgd", "lr": lr, "momentum": momentum, "nesterov": True,
        "weight_decay": None if decay is None else workload.WeightDecay(**decay)})})


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed")
@pytest.mark.parametrize("decay", [None, {"kind": "decoupled", "rate": 0.5}])
def test_torch_nesterov_and_decoupled_decay_step_as_keras(decay):
    w = nesterov_spec(decay=decay)
    p, p0, grads = torch_steps(w)
    ref, want = ops.make_optimizer(w.training), p0.copy()
    for g in grads:
        if decay:
            ops.decay_decoupled([want], w.training.lr, decay["rate"])
        ref.step([want], [g])
    assert close(p.detach().numpy(), want, w.training.lr) < 1e-3
    plain = reference_params(ops.SGD(0.05, 0.9), p0, grads)  # the control: momentum without Nesterov
    assert close(plain, want, w.training.lr) > 1e-2  # measured 0.098: a hundred times the tolerance


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="JAX is not installed")
def test_the_jax_nesterov_steps_as_keras():
    import jax.numpy as jnp

    from benchbackend.backends.jax import adapter as jb

    p0 = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    grads = gradients(p0.shape, 0)
    params, state = [jnp.asarray(p0)], jb._init_state("sgd", 0.9, [jnp.asarray(p0)])
    for g in grads:
        params, state = jb._update("sgd", 0.05, 0.9, params, [jnp.asarray(g)], state, nesterov=True)
    want = reference_params(ops.SGD(0.05, 0.9, nesterov=True), p0, grads)
    assert close(np.asarray(params[0]), want, 0.05) < 1e-3
