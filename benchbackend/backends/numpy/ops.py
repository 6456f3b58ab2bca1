"""Array kernels of the NumPy reference: each layer's forward and backward, the loss, optimizers.

Every function finds its array module from its arguments (``get_array_module``), so the same code
runs on NumPy arrays and on CuPy device arrays. Layouts are canonical (``benchbackend.spec.model``):
NHWC activations, HWIO conv kernels, ``(in, out)`` dense kernels. Forward functions return
``(output, cache)``; backward functions take the upstream gradient and that cache.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Optional, Protocol, Sequence

import numpy as np

from ...spec.graph import resolve_pads
from ...spec.workload import TrainingSpec

Array = Any  # numpy.ndarray or cupy.ndarray


def get_array_module(x: Array) -> ModuleType:
    """``cupy`` for a CuPy array, else ``numpy`` (CuPy is imported only when it made the array)."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


# --- windows ---------------------------------------------------------------------------------
def _tap(i: int, j: int, stride: int, ho: int, wo: int) -> tuple[slice, slice, slice, slice]:
    """Index of kernel tap (i, j) over all output positions: a strided view of the input."""
    return (slice(None), slice(i, i + stride * (ho - 1) + 1, stride),
            slice(j, j + stride * (wo - 1) + 1, stride), slice(None))


def _gather(x: Array, k: int, stride: int, ho: int, wo: int) -> Array:
    """Every k x k window of ``x`` (NHWC), its k*k taps (row-major (i, j)) stacked first:
    (k*k, N, Ho, Wo, C), for reductions over the taps (pooling; a convolution's are :func:`_im2col`)."""
    xp = get_array_module(x)
    return xp.stack([x[_tap(i, j, stride, ho, wo)] for i in range(k) for j in range(k)])


def _im2col(x: Array, k: int, stride: int, ho: int, wo: int) -> Array:
    """The (N*Ho*Wo, k*k*C) matrix of every k x k window of ``x`` (NHWC), taps row-major (i, j)
    then channels. One copy of a strided view: a window row's k*C values are contiguous in ``x``,
    which copies 3-5x faster than stacking the k*k taps (C >= 8, measured)."""
    xp = get_array_module(x)
    n, _, _, c = x.shape
    sn, sh, sw, sc = x.strides
    view = xp.lib.stride_tricks.as_strided(x, (n, ho, wo, k, k, c), (sn, sh * stride, sw * stride, sh, sw, sc))
    return view.reshape(n * ho * wo, k * k * c)


def _scatter(taps: Array, shape: tuple[int, ...], k: int, stride: int) -> Array:
    """Adjoint of ``_gather``: add each tap's values back where it was read (windows may overlap)."""
    xp = get_array_module(taps)
    _, _, ho, wo, _ = taps.shape
    out = xp.zeros(shape, taps.dtype)
    for t in range(k * k):
        out[_tap(t // k, t % k, stride, ho, wo)] += taps[t]
    return out


# --- layers ----------------------------------------------------------------------------------
Pads = tuple[tuple[int, int], tuple[int, int]]


def _pads(padding: Any, x: Array, k: int, stride: int) -> Pads:
    """``padding`` in any layer form (``same``, ``valid``, int, pairs) for an NHWC ``x``."""
    return resolve_pads(padding, x.shape[1], x.shape[2], k, stride)


def conv2d(x: Array, w: Array, b: Optional[Array], stride: int, padding: Any) -> tuple[Array, tuple]:
    """NHWC x HWIO convolution (cross-correlation, as every framework computes it) via im2col.
    ``padding``: ``same`` (TensorFlow's), ``valid``, an int or ((top, bottom), (left, right));
    ``b`` None: no bias."""
    xp = get_array_module(x)
    n, h, wd, c = x.shape
    k, f = w.shape[0], w.shape[3]
    (pt, pb), (pl, pr) = _pads(padding, x, k, stride)
    if pt or pb or pl or pr:
        x = xp.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)))
    ho, wo = (x.shape[1] - k) // stride + 1, (x.shape[2] - k) // stride + 1
    cols = _im2col(x, k, stride, ho, wo)
    out = cols @ w.reshape(k * k * c, f)
    if b is not None:
        out += b
    return out.reshape(n, ho, wo, f), (cols, w, stride, x.shape, (pt, pl), (h, wd), b is not None)


def conv2d_backward(g: Array, cache: tuple, need_dx: bool = True
                    ) -> tuple[Optional[Array], Array, Optional[Array]]:
    """(dx, dw, db); ``dx`` is None when not needed (the first layer), which saves the col2im;
    ``db`` is None for a convolution without bias."""
    cols, w, stride, padded_shape, (pt, pl), (h, wd), has_bias = cache
    n, ho, wo, f = g.shape
    k, c = w.shape[0], w.shape[2]
    g2 = g.reshape(n * ho * wo, f)
    dw = (cols.T @ g2).reshape(w.shape)
    db = g2.sum(axis=0) if has_bias else None
    if not need_dx:
        return None, dw, db
    # col2im one tap at a time: each (N*Ho*Wo, C) product is contiguous, which makes the strided
    # accumulation several times faster than slicing one big (N*Ho*Wo, k*k*C) matrix.
    w_taps = w.reshape(k * k, c, f)
    dx = get_array_module(g).zeros(padded_shape, g.dtype)
    for t in range(k * k):
        dx[_tap(t // k, t % k, stride, ho, wo)] += (g2 @ w_taps[t].T).reshape(n, ho, wo, c)
    return dx[:, pt:pt + h, pl:pl + wd, :], dw, db


def maxpool2d(x: Array, pool: int, stride: int, padding: Any = "valid") -> tuple[Array, tuple]:
    """Max pooling (Keras' default: 'valid', stride = pool size); pads are -inf, so they never win
    a max. Remembers the first maximum of each window."""
    xp = get_array_module(x)
    n, h, w, c = x.shape
    (pt, pb), (pl, pr) = _pads(padding, x, pool, stride)
    if pt or pb or pl or pr:
        x = xp.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)), constant_values=-xp.inf)
    ho, wo = (x.shape[1] - pool) // stride + 1, (x.shape[2] - pool) // stride + 1
    windows = _gather(x, pool, stride, ho, wo)  # (p*p, N, Ho, Wo, C)
    arg = windows.argmax(axis=0)
    return windows.max(axis=0), (arg, x.shape, pool, stride, (pt, pl), (h, w))


def maxpool2d_backward(g: Array, cache: tuple) -> Array:
    """Routes each output's gradient to its window's argmax (ties: the first in row-major order, as torch)."""
    xp = get_array_module(g)
    arg, shape, pool, stride, (pt, pl), (h, w) = cache
    hit = arg[None] == xp.arange(pool * pool).reshape(-1, 1, 1, 1, 1)
    return _scatter(hit * g[None], shape, pool, stride)[:, pt:pt + h, pl:pl + w, :]


def batchnorm_train(x: Array, gamma: Array, beta: Array, epsilon: float) -> tuple[Array, tuple, Array, Array]:
    """Training-mode batch normalization over every axis but the last: (output, cache, batch mean,
    batch variance). The variance is the biased one (divided by the count), as Keras uses it."""
    axes = tuple(range(x.ndim - 1))
    mean = x.mean(axis=axes)
    var = ((x - mean) ** 2).mean(axis=axes)
    inv = 1.0 / get_array_module(x).sqrt(var + epsilon)
    xhat = (x - mean) * inv
    return xhat * gamma + beta, (xhat, inv, gamma), mean, var


def batchnorm_train_backward(g: Array, cache: tuple) -> tuple[Array, Array, Array]:
    """(dx, dgamma, dbeta) through the batch statistics."""
    xhat, inv, gamma = cache
    axes = tuple(range(g.ndim - 1))
    dxhat = g * gamma
    dx = inv * (dxhat - dxhat.mean(axis=axes) - xhat * (dxhat * xhat).mean(axis=axes))
    return dx, (g * xhat).sum(axis=axes), g.sum(axis=axes)


def batchnorm_infer(x: Array, gamma: Array, beta: Array, mean: Array, var: Array, epsilon: float) -> Array:
    """Inference-mode batch normalization with the moving statistics."""
    return (x - mean) / get_array_module(x).sqrt(var + epsilon) * gamma + beta


def moving_update(moving: Array, batch: Array, momentum: float) -> None:
    """Keras' moving average, in place: ``moving = momentum * moving + (1 - momentum) * batch``."""
    moving *= momentum
    moving += (1 - momentum) * batch


def global_avgpool(x: Array) -> Array:
    """The mean over every axis but the batch's and the last: the pixels (NHWC) or the tokens (N, T, d)."""
    return x.mean(axis=tuple(range(1, x.ndim - 1)))


def global_avgpool_backward(g: Array, shape: tuple[int, ...]) -> Array:
    xp = get_array_module(g)
    inner = shape[1:-1]
    spread = (g / int(np.prod(inner))).reshape((shape[0],) + (1,) * len(inner) + (shape[-1],))
    return xp.broadcast_to(spread, shape).copy()


def dense(x: Array, w: Array, b: Array) -> tuple[Array, tuple]:
    """``x @ w + b`` on the last axis: a flat (N, F) input or a token sequence (N, T, d)."""
    return x @ w + b, (x, w)


def dense_backward(g: Array, cache: tuple) -> tuple[Array, Array, Array]:
    x, w = cache
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])  # tokens count as samples
    return g @ w.T, x2.T @ g2, g2.sum(axis=0)


def dropout(x: Array, rate: float, rng: Any) -> tuple[Array, Array]:
    """Inverted dropout (Keras semantics): keep with probability 1-rate, scale kept units by 1/(1-rate)."""
    keep = rng.random(x.shape, dtype=np.float32) >= rate
    scale = (keep / (1.0 - rate)).astype(x.dtype)
    return x * scale, scale


# --- activations and loss ----------------------------------------------------------------------
def softmax(z: Array) -> Array:
    xp = get_array_module(z)
    e = xp.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def activate(z: Array, fn: str) -> Array:
    xp = get_array_module(z)
    if fn == "relu":
        return xp.maximum(z, 0)
    if fn == "tanh":
        return xp.tanh(z)
    if fn == "sigmoid":
        return 0.5 * (xp.tanh(0.5 * z) + 1)  # = 1/(1+exp(-z)), without overflow for large -z
    if fn == "softmax":
        return softmax(z)
    return z


def activate_backward(g: Array, fn: str, z: Array, a: Array) -> Array:
    """Gradient through ``a = activate(z, fn)``; softmax over the last axis, as Keras applies it."""
    if fn == "relu":
        return g * (z > 0)
    if fn == "tanh":
        return g * (1 - a * a)
    if fn == "sigmoid":
        return g * a * (1 - a)
    if fn == "softmax":
        return a * (g - (g * a).sum(axis=-1, keepdims=True))
    return g


def softmax_cross_entropy(logits: Array, y: Array) -> tuple[Array, Array, Array]:
    """(mean loss, per-sample losses, probabilities) of categorical cross-entropy on logits.

    ``-sum(y * log_softmax(z))`` is computed from the logits with log-sum-exp, so no probability is
    clipped. That is what Keras 3 on TensorFlow does for a softmax output (it finds the logits behind
    the softmax); the Keras clip of probabilities to [1e-7, 1 - 1e-7] would only change losses above
    -log(1e-7) = 16.1, which a parity check never meets.
    """
    xp = get_array_module(logits)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    lse = xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))
    per_sample = -(y * (shifted - lse)).sum(axis=-1)
    return per_sample.mean(), per_sample, xp.exp(shifted - lse)


def one_hot(labels: Array, num_classes: int, dtype: Any) -> Array:
    xp = get_array_module(labels)
    return xp.eye(num_classes, dtype=dtype)[labels]


# --- optimizers (Keras 3 update rules and defaults) ------------------------------------------
class Optimizer(Protocol):
    def step(self, params: Sequence[Array], grads: Sequence[Array]) -> None:
        """Update ``params`` in place from ``grads`` (same order), advancing the optimizer's state."""


class SGD:
    """Keras SGD: ``v = momentum * v - lr * g; w += v`` (plain ``w -= lr * g`` without momentum);
    Nesterov: ``w += momentum * v - lr * g`` with the new ``v``."""

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False):
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.velocity: Optional[list[Array]] = None

    def step(self, params: Sequence[Array], grads: Sequence[Array]) -> None:
        if not self.momentum:
            for p, g in zip(params, grads):
                p -= self.lr * g
            return
        if self.velocity is None:
            self.velocity = [get_array_module(p).zeros_like(p) for p in params]
        for p, g, v in zip(params, grads, self.velocity):
            v *= self.momentum
            v -= self.lr * g
            if self.nesterov:
                p += self.momentum * v - self.lr * g
            else:
                p += v


def keras_adam_step_size(lr: float, beta_1: float, beta_2: float, t: int) -> float:
    """Keras 3 Adam's ``lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)``, computed in float32 as Keras does."""
    f = np.float32
    with np.errstate(all="ignore"):
        return float(f(lr) * np.sqrt(f(1) - f(beta_2) ** f(t)) / (f(1) - f(beta_1) ** f(t)))


class Adam:
    """Keras 3 Adam: epsilon is added to sqrt(v) *before* bias correction is folded into the step
    size (``lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t)``), which differs from torch.optim.Adam.

    Keras computes that step size in the variables' dtype, float32, where 0.999 is 0.99900001287:
    ``1 - b2^1`` comes out 1.3e-5 (relative) below 0.001. So does this reference, also in float64
    mode; computed exactly instead, 20 cifar10 steps drift 5e-3 from Keras while agreeing to 1e-6
    with it computed in float32 (see :func:`keras_adam_step_size`)."""

    def __init__(self, lr: float, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7):
        self.lr, self.beta_1, self.beta_2, self.epsilon = lr, beta_1, beta_2, epsilon
        self.t = 0
        self.m: Optional[list[Array]] = None
        self.v: Optional[list[Array]] = None

    def step(self, params: Sequence[Array], grads: Sequence[Array]) -> None:
        if self.m is None or self.v is None:
            self.m = [get_array_module(p).zeros_like(p) for p in params]
            self.v = [get_array_module(p).zeros_like(p) for p in params]
        self.t += 1
        alpha = keras_adam_step_size(self.lr, self.beta_1, self.beta_2, self.t)
        for p, g, m, v in zip(params, grads, self.m, self.v):
            xp = get_array_module(p)
            m += (g - m) * (1 - self.beta_1)
            v += (g * g - v) * (1 - self.beta_2)
            p -= alpha * m / (xp.sqrt(v) + self.epsilon)


class RMSprop:
    """Keras 3 RMSprop (not centered, no momentum): ``v = rho v + (1-rho) g^2; w -= lr g / sqrt(v + eps)``.

    Keras puts epsilon *inside* the square root (torch.optim.RMSprop adds it outside, and its
    default rho is 0.99, not 0.9).
    """

    def __init__(self, lr: float, rho: float = 0.9, epsilon: float = 1e-7):
        self.lr, self.rho, self.epsilon = lr, rho, epsilon
        self.v: Optional[list[Array]] = None

    def step(self, params: Sequence[Array], grads: Sequence[Array]) -> None:
        if self.v is None:
            self.v = [get_array_module(p).zeros_like(p) for p in params]
        for p, g, v in zip(params, grads, self.v):
            xp = get_array_module(p)
            v *= self.rho
            v += (1 - self.rho) * g * g
            p -= self.lr * g / xp.sqrt(v + self.epsilon)


def make_optimizer(training: TrainingSpec) -> Optimizer:
    """The workload's optimizer with Keras 3 defaults; ``momentum`` and ``nesterov`` apply to SGD only."""
    if training.optimizer == "sgd":
        return SGD(training.lr, training.momentum, training.nesterov)
    if training.optimizer == "adam":
        return Adam(training.lr)
    if training.optimizer == "rmsprop":
        return RMSprop(training.lr)
    raise ValueError(f"unknown optimizer {training.optimizer!r}")


# --- weight decay (``training.weight_decay``) --------------------------------------------------
def l2_penalty(kernels: Sequence[Array], rate: float) -> Array:
    """Keras' ``L2(rate)`` kernel regularizer summed over ``kernels``: ``rate * sum(k ** 2)``."""
    return sum(rate * (k * k).sum() for k in kernels)


def decay_decoupled(kernels: Sequence[Array], lr: float, rate: float) -> None:
    """Keras 3's ``weight_decay`` (AdamW's), applied before the update: ``k -= k * rate * lr``, in place."""
    for k in kernels:
        k -= k * (rate * lr)
