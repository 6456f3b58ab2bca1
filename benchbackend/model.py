"""The layer vocabulary shared by all backends: shapes, parameter counts, FLOPs, initial weights.

Canonical layout (what every adapter converts from):
- activations NHWC;
- conv kernels HWIO ``(kh, kw, c_in, c_out)``, biases ``(c_out,)``;
- dense kernels ``(in, out)`` whose input rows follow NHWC flatten order ``(h, w, c)``.

The weights are a flat list ``[kernel0, bias0, kernel1, bias1, ...]`` over the conv and dense
layers in order, which is also the order of Keras ``get_weights``/``set_weights``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .workload import Conv2D, Dense, Flatten, MaxPool2D, Workload


def same_pads(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow/Keras 'same' padding: (before, after); the extra pixel goes after."""
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def conv_out(size: int, kernel: int, stride: int, padding: str) -> int:
    if padding == "same":
        return math.ceil(size / stride)
    return (size - kernel) // stride + 1


@dataclass(frozen=True)
class LayerInfo:
    index: int
    kind: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    params: int
    flops: int  # forward FLOPs per sample, counting a multiply-add as 2


def describe(workload: Workload) -> list[LayerInfo]:
    """Shape-infer the spec; raises ``ValueError`` when a layer does not fit its input."""
    shape: tuple[int, ...] = tuple(workload.input_shape)
    out: list[LayerInfo] = []
    for i, layer in enumerate(workload.model):
        params = flops = 0
        if isinstance(layer, Conv2D):
            if len(shape) != 3:
                raise ValueError(f"model[{i}] conv2d needs an image input (H, W, C), got shape {shape}")
            h, w, c = shape
            ho = conv_out(h, layer.kernel_size, layer.stride, layer.padding)
            wo = conv_out(w, layer.kernel_size, layer.stride, layer.padding)
            if ho <= 0 or wo <= 0:
                raise ValueError(f"model[{i}] conv2d kernel {layer.kernel_size} does not fit input {shape}")
            k2c = layer.kernel_size * layer.kernel_size * c
            params = k2c * layer.filters + layer.filters
            flops = 2 * k2c * layer.filters * ho * wo
            new: tuple[int, ...] = (ho, wo, layer.filters)
        elif isinstance(layer, MaxPool2D):
            if len(shape) != 3:
                raise ValueError(f"model[{i}] maxpool2d needs an image input, got shape {shape}")
            s = layer.stride or layer.pool_size
            h, w, c = shape
            ho, wo = (h - layer.pool_size) // s + 1, (w - layer.pool_size) // s + 1
            if ho <= 0 or wo <= 0:
                raise ValueError(f"model[{i}] maxpool2d pool {layer.pool_size} does not fit input {shape}")
            new = (ho, wo, c)
            flops = h * w * c
        elif isinstance(layer, Flatten):
            new = (int(np.prod(shape)),)
        elif isinstance(layer, Dense):
            if len(shape) != 1:
                raise ValueError(f"model[{i}] dense needs a flat input (add a flatten layer), got shape {shape}")
            params = shape[0] * layer.units + layer.units
            flops = 2 * shape[0] * layer.units
            new = (layer.units,)
        else:  # dropout, activation: shape-preserving
            new = shape
        out.append(LayerInfo(i, layer.type, shape, new, params, flops))
        shape = new
    if shape != (workload.num_classes,):
        raise ValueError(f"the model's output shape is {shape}; it must be ({workload.num_classes},), "
                         "one score per class")
    return out


def param_count(workload: Workload) -> int:
    return sum(li.params for li in describe(workload))




def flops_per_sample(workload: Workload) -> int:
    """Forward FLOPs of one sample (a multiply-add counts 2); training: x ``peaks.TRAIN_FLOPS_FACTOR``."""
    return sum(li.flops for li in describe(workload))


def weight_shapes(workload: Workload) -> list[tuple[int, ...]]:
    """Canonical shapes of ``[kernel0, bias0, ...]``."""
    shapes: list[tuple[int, ...]] = []
    for li, layer in zip(describe(workload), workload.model):
        if isinstance(layer, Conv2D):
            c_in = li.in_shape[2]
            shapes += [(layer.kernel_size, layer.kernel_size, c_in, layer.filters), (layer.filters,)]
        elif isinstance(layer, Dense):
            shapes += [(li.in_shape[0], layer.units), (layer.units,)]
    return shapes


def initial_weights(workload: Workload, repeat: int = 0) -> list[np.ndarray]:
    """Keras-default initial weights (Glorot-uniform kernels, zero biases), float32, canonical layout.

    Deterministic in (workload.seed, repeat): every backend of a repeat starts from these.
    """
    rng = np.random.default_rng([workload.seed, repeat, 0x5EED])
    weights: list[np.ndarray] = []
    for shape in weight_shapes(workload):
        if len(shape) == 1:
            weights.append(np.zeros(shape, np.float32))
            continue
        receptive = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
        fan_in, fan_out = shape[-2] * receptive, shape[-1] * receptive
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        weights.append(rng.uniform(-limit, limit, size=shape).astype(np.float32))
    return weights


def flatten_input_shape(workload: Workload) -> tuple[int, int, int] | None:
    """(H, W, C) of the activation entering the first ``flatten`` layer, or None."""
    for li, layer in zip(describe(workload), workload.model):
        if isinstance(layer, Flatten) and len(li.in_shape) == 3:
            return li.in_shape  # type: ignore[return-value]
    return None


def nhwc_to_nchw_rows(h: int, w: int, c: int) -> np.ndarray:
    """Index array ``p`` with ``kernel_nchw = kernel_nhwc[p]`` for a dense layer after flatten.

    Row ``i`` of an NCHW-flattened input is element (c, h, w); it sits at row ``(h*W + w)*C + c``
    of the NHWC-flattened kernel.
    """
    cc, hh, ww = np.meshgrid(np.arange(c), np.arange(h), np.arange(w), indexing="ij")
    return ((hh * w + ww) * c + cc).reshape(-1)


def to_nchw_weights(workload: Workload, weights: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The canonical weights for an NCHW framework (torch, Chainer): conv kernels OIHW, dense
    kernels (out, in), the first dense kernel after a flatten with its rows in NCHW flatten order;
    biases unchanged. Inverse: :func:`from_nchw_weights`."""
    shape = flatten_input_shape(workload)
    rows = None if shape is None else nhwc_to_nchw_rows(*shape)
    out: list[np.ndarray] = []
    first_dense = True
    for k, b in zip(weights[0::2], weights[1::2]):
        if k.ndim == 4:
            out.append(np.ascontiguousarray(np.transpose(k, (3, 2, 0, 1))))  # HWIO -> OIHW
        else:
            out.append(np.ascontiguousarray((k[rows] if first_dense and rows is not None else k).T))
            first_dense = False
        out.append(np.array(b))
    return out


def from_nchw_weights(workload: Workload, weights: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The canonical layout back from :func:`to_nchw_weights`' layout."""
    shape = flatten_input_shape(workload)
    rows = None if shape is None else nhwc_to_nchw_rows(*shape)
    out: list[np.ndarray] = []
    first_dense = True
    for w, b in zip(weights[0::2], weights[1::2]):
        if w.ndim == 4:
            out.append(np.ascontiguousarray(np.transpose(w, (2, 3, 1, 0))))  # OIHW -> HWIO
        else:
            k = w.T
            if first_dense and rows is not None:
                k = k[np.argsort(rows)]
            first_dense = False
            out.append(np.ascontiguousarray(k))
        out.append(np.array(b))
    return out


def final_softmax(layers: Sequence[Any]) -> bool:
    """True when the network ends in a softmax (so it outputs probabilities, not logits)."""
    last = layers[-1]
    return getattr(last, "activation", getattr(last, "function", "none")) == "softmax"
