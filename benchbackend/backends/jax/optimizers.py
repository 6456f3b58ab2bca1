"""Keras 3's optimizers written out for the JAX adapter (update rules and defaults of
``keras.optimizers.SGD`` / ``Adam`` / ``RMSprop``): optax's Adam adds epsilon to the
*bias-corrected* sqrt(v), Keras' to the raw one."""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from .graph import Params


def _init_state(optimizer: str, momentum: float, params: Params) -> dict[str, Any]:
    zeros = lambda: [jnp.zeros_like(p) for p in params]  # noqa: E731
    if optimizer == "adam":
        return {"t": jnp.zeros((), jnp.int32), "m": zeros(), "v": zeros()}
    if optimizer == "rmsprop":
        return {"v": zeros()}
    return {"v": zeros()} if momentum else {}


def _update(optimizer: str, lr: float, momentum: float, params: Params, grads: Params,
            state: dict[str, Any], nesterov: bool = False) -> tuple[Params, dict[str, Any]]:
    if optimizer == "adam":
        b1, b2, eps = 0.9, 0.999, 1e-7
        t = state["t"] + 1
        tf = t.astype(jnp.float32)
        # Keras: epsilon is added to sqrt(v) before the bias correction, which goes into the step
        # size, computed in float32 as Keras does (1 - 0.999**t in float32 is 1e-5 off the exact
        # value at t=1, and 20 Adam steps on cifar10 amplify that to 5e-3 in the loss).
        alpha = lr * jnp.sqrt(1 - b2 ** tf) / (1 - b1 ** tf)
        m = [m + (g - m) * (1 - b1) for m, g in zip(state["m"], grads)]
        v = [v + (g * g - v) * (1 - b2) for v, g in zip(state["v"], grads)]
        new = [p - alpha * mi / (jnp.sqrt(vi) + eps) for p, mi, vi in zip(params, m, v)]
        return new, {"t": t, "m": m, "v": v}
    if optimizer == "rmsprop":
        rho, eps = 0.9, 1e-7
        v = [rho * v + (1 - rho) * g * g for v, g in zip(state["v"], grads)]
        # Keras puts epsilon inside the square root.
        return [p - lr * g / jnp.sqrt(vi + eps) for p, g, vi in zip(params, grads, v)], {"v": v}
    if momentum:
        v = [momentum * v - lr * g for v, g in zip(state["v"], grads)]
        if nesterov:  # Keras: w += momentum * v - lr * g, with the new v
            return [p + momentum * vi - lr * g for p, vi, g in zip(params, v, grads)], {"v": v}
        return [p + vi for p, vi in zip(params, v)], {"v": v}
    return [p - lr * g for p, g in zip(params, grads)], state
