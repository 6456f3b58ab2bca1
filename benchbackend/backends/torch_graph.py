"""The resolved graph (``benchbackend.graph``) as a ``torch.nn.Module``, NCHW, in the harness' conventions.

Where torch's defaults differ from the NumPy reference's conventions, this module converts:

- TF 'same' and asymmetric padding: an explicit ``F.pad`` before the conv (torch pads symmetrically);
- max-pool padding: ``-inf`` pads, so a pad never wins a max;
- batchnorm (:class:`BatchNorm`): Keras' momentum (``moving = m * moving + (1 - m) * batch``; torch's
  ``momentum`` weights the *new* batch) and the *biased* batch variance in the moving variance
  (``nn.BatchNorm2d`` updates it with the unbiased one); the epsilon comes from the spec;
- dropout that the trajectory check can switch off while batchnorm stays in training mode.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..graph import INPUT, Graph, Node
from ..layers import ActivationLayer, Add, BatchNorm, Conv2D, Dense, Dropout, Flatten, GlobalAvgPool, MaxPool2D

_ACT = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}


def activation(name: str) -> nn.Module:
    if name == "none":
        return nn.Identity()
    if name == "softmax":
        return nn.Softmax(dim=1)  # channels (NCHW) or features
    return _ACT[name]()


class BatchNormKeras(nn.Module):
    """Batch normalization over every axis but the channels (axis 1), in Keras' convention: batch
    statistics in training (the moving ones updated with Keras' momentum and the biased variance,
    unless ``update`` is off), the moving statistics in eval mode."""

    def __init__(self, channels: int, momentum: float, epsilon: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))
        self.momentum, self.epsilon = momentum, epsilon
        self.update = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.epsilon)
        # No running buffers given: torch normalizes with the batch's (biased) statistics and updates nothing.
        out = F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.epsilon)
        if self.update:
            with torch.no_grad():
                dims = [d for d in range(x.dim()) if d != 1]
                var, mean = torch.var_mean(x.detach().float(), dim=dims, correction=0)
                self.running_mean.mul_(self.momentum).add_(mean, alpha=1.0 - self.momentum)
                self.running_var.mul_(self.momentum).add_(var, alpha=1.0 - self.momentum)
        return out


class SwitchableDropout(nn.Dropout):
    """``nn.Dropout`` that ``enabled = False`` turns off in training mode too (the trajectory check)."""

    enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, self.training and self.enabled)


class Padded(nn.Module):
    """``F.pad`` with (left, right, top, bottom) and a fill value, then ``inner``."""

    def __init__(self, pads: tuple[int, int, int, int], value: float, inner: nn.Module):
        super().__init__()
        self.pads, self.value, self.inner = pads, value, inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(F.pad(x, self.pads, value=self.value))


def _window(node: Node, make: Any, fill: float) -> nn.Module:
    """A conv or pool with the node's padding: torch's own symmetric ``padding`` where it fits,
    else an explicit pad."""
    (top, bottom), (left, right) = node.pads  # type: ignore[misc]
    k = node.layer.kernel_size if isinstance(node.layer, Conv2D) else node.layer.pool_size
    if top == bottom and left == right and (fill == 0.0 or max(top, left) <= k // 2):
        return make((top, left))
    return Padded((left, right, top, bottom), fill, make((0, 0)))


def node_module(node: Node, last: bool) -> nn.Module:
    """The node's computation (its activation included; a final softmax is left to the loss)."""
    layer = node.layer
    act = activation("none" if last and node.activation == "softmax" else node.activation)
    if isinstance(layer, Conv2D):
        c_in = node.in_shape[2]
        conv = _window(node, lambda pad: nn.Conv2d(c_in, layer.filters, layer.kernel_size, layer.stride, pad,
                                                   bias=layer.use_bias), 0.0)
        return nn.Sequential(conv, act)
    if isinstance(layer, MaxPool2D):
        stride = layer.stride or layer.pool_size
        return _window(node, lambda pad: nn.MaxPool2d(layer.pool_size, stride, pad), float("-inf"))
    if isinstance(layer, Dense):
        return nn.Sequential(nn.Linear(node.in_shape[0], layer.units), act)
    if isinstance(layer, BatchNorm):
        return nn.Sequential(BatchNormKeras(node.in_shape[-1], layer.momentum, layer.epsilon), act)
    if isinstance(layer, Add):
        return act
    if isinstance(layer, GlobalAvgPool):
        return _GlobalAvgPool()
    if isinstance(layer, Dropout):
        return SwitchableDropout(layer.rate)
    if isinstance(layer, Flatten):
        return nn.Flatten()
    if isinstance(layer, ActivationLayer):
        return act
    raise TypeError(f"{node.label()}: no torch translation")


class _GlobalAvgPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


class GraphNet(nn.Module):
    """The graph's nodes in order; each value is dropped after its last reader (ResNet-50's
    activations do not all fit at once)."""

    def __init__(self, graph: Graph):
        super().__init__()
        n = len(graph.nodes)
        self.nodes = nn.ModuleList(node_module(node, i == n - 1) for i, node in enumerate(graph.nodes))
        self.inputs = [node.inputs for node in graph.nodes]
        self.is_add = [isinstance(node.layer, Add) for node in graph.nodes]
        last_use = {j: i for i, node in enumerate(graph.nodes) for j in node.inputs}
        self.free_after = [[j for j, last in last_use.items() if last == i and j != INPUT] for i in range(n)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values: dict[int, torch.Tensor] = {INPUT: x}
        out = x
        for i, mod in enumerate(self.nodes):
            ins = [values[j] for j in self.inputs[i]]
            if self.is_add[i]:
                total = ins[0]
                for other in ins[1:]:
                    total = total + other
                out = mod(total)
            else:
                out = mod(ins[0])
            values[i] = out
            for j in self.free_after[i]:
                del values[j]
        return out

    # --- the weights, node by node, in the canonical list's order ---------------------------------
    def arrays(self) -> list[torch.Tensor]:
        """Every weight tensor (parameters and moving statistics) in canonical order (NCHW layouts)."""
        out: list[torch.Tensor] = []
        for mod in self.nodes:
            for m in mod.modules():
                if isinstance(m, (nn.Conv2d, nn.Linear)):
                    out += [m.weight] + ([m.bias] if m.bias is not None else [])
                elif isinstance(m, BatchNormKeras):
                    out += [m.weight, m.bias, m.running_mean, m.running_var]
        return out

    def kernels(self) -> list[torch.Tensor]:
        return [m.weight for m in self.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]

    def set_mode(self, dropout: bool, update_statistics: bool) -> None:
        for m in self.modules():
            if isinstance(m, SwitchableDropout):
                m.enabled = dropout
            elif isinstance(m, BatchNormKeras):
                m.update = update_statistics

    def load(self, arrays: Sequence[Any]) -> None:
        targets = self.arrays()
        if len(targets) != len(arrays):
            raise ValueError(f"the network has {len(targets)} weight arrays; got {len(arrays)}")
        with torch.no_grad():
            for t, a in zip(targets, arrays):
                t.copy_(torch.from_numpy(a))


def count(net: Optional[GraphNet]) -> int:
    return 0 if net is None else sum(t.numel() for t in net.arrays())
