"""The resolved graph (``benchbackend.spec.graph``) as a ``torch.nn.Module``, NCHW, in the harness' conventions.

Where torch's defaults differ from the NumPy reference's conventions, this module converts:

- TF 'same' and asymmetric padding: an explicit ``F.pad`` before the conv (torch pads symmetrically);
- max-pool padding: ``-inf`` pads, so a pad never wins a max;
- batchnorm (:class:`BatchNorm`): Keras' momentum (``moving = m * moving + (1 - m) * batch``; torch's
  ``momentum`` weights the *new* batch) and the *biased* batch variance in the moving variance
  (``nn.BatchNorm2d`` updates it with the unbiased one); the epsilon comes from the spec;
- dropout that the trajectory check can switch off while batchnorm stays in training mode;
- a softmax over the channels: axis 1 of an NCHW image, the last axis of a flat vector or a token sequence;
- a dense layer ``tied_to`` an embedding reads the embedding's own table parameter (``tt.TiedDense``):
  one array, so both uses' gradients sum in it; ``multiply`` is the elementwise product of its inputs;
- the transformer layers: ``torch_transformer``.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...spec import layers
from ...spec.graph import INPUT, Graph, Node
from ...spec.layers import (
    TOKEN_LAYERS,
    ActivationLayer,
    Add,
    BatchNorm,
    Conv2D,
    Dense,
    Dropout,
    Flatten,
    GlobalAvgPool,
    MaxPool2D,
    Multiply,
    gelu_approximate,
)
from ...spec.model import kernel_mask
from . import transformer as tt

_ACT = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "silu": nn.SiLU}


def activation(name: str, node: Optional[Node] = None) -> nn.Module:
    """The activation ``name`` (of ``node``, which says GELU's form and the softmax's axis)."""
    if name == "none":
        return nn.Identity()
    if name == "softmax":  # over the channels: axis 1 of an NCHW image, else the last axis
        return nn.Softmax(dim=1 if node is not None and len(node.out_shape) == 3 else -1)
    if name == "gelu":
        return tt.gelu(node is not None and gelu_approximate(node.layer))
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


def node_module(node: Node, last: bool, fused_attention: bool = False) -> nn.Module:
    """The node's computation (its activation included; a final softmax is left to the loss);
    ``fused_attention``: attention through ``F.scaled_dot_product_attention``."""
    layer = node.layer
    act = activation("none" if last and node.activation == "softmax" else node.activation, node)
    if isinstance(layer, Conv2D):
        c_in = node.in_shape[2]
        conv = _window(node, lambda pad: nn.Conv2d(c_in, layer.filters, layer.kernel_size, layer.stride, pad,
                                                   bias=layer.use_bias), 0.0)
        return nn.Sequential(conv, act)
    if isinstance(layer, MaxPool2D):
        stride = layer.stride or layer.pool_size
        return _window(node, lambda pad: nn.MaxPool2d(layer.pool_size, stride, pad), float("-inf"))
    if isinstance(layer, TOKEN_LAYERS):
        return _token_module(node, fused_attention)
    if isinstance(layer, Dense) and node.tied is not None:  # the kernel is an embedding's table
        return nn.Sequential(tt.TiedDense(layer.units, layer.use_bias), act)
    if isinstance(layer, Dense):  # on features (N, F), or on the last axis of tokens (N, T, d)
        return nn.Sequential(nn.Linear(node.in_shape[-1], layer.units, bias=layer.use_bias), act)
    if isinstance(layer, BatchNorm):
        norm: nn.Module = BatchNormKeras(node.in_shape[-1], layer.momentum, layer.epsilon)
        return nn.Sequential(tt.TokenChannels(norm) if len(node.in_shape) == 2 else norm, act)
    if isinstance(layer, (Add, Multiply)):
        return act
    if isinstance(layer, GlobalAvgPool):
        return _GlobalAvgPool(dims=(1,) if len(node.in_shape) == 2 else (2, 3))  # over tokens, or pixels
    if isinstance(layer, Dropout):
        return SwitchableDropout(layer.rate)
    if isinstance(layer, Flatten):
        return nn.Flatten()
    if isinstance(layer, ActivationLayer):
        return act
    raise TypeError(f"{node.label()}: no torch translation")


def _token_module(node: Node, fused_attention: bool) -> nn.Module:
    layer, shape = node.layer, node.in_shape
    if isinstance(layer, layers.LayerNorm):
        norm = tt.layernorm(shape[-1], layer.epsilon)
        return tt.ImageLayerNorm(norm) if len(shape) == 3 else norm
    if isinstance(layer, layers.Attention):
        rope = None if layer.rope is None else (layer.rope.base, layer.rope.pairing)
        return tt.Attention(shape[-1], layer.heads, layer.head_dim, fused_attention, causal=layer.causal,
                            kv_heads=layer.kv_heads, rope_=rope, use_bias=layer.use_bias, tokens=shape[0])
    if isinstance(layer, layers.Embedding):
        return tt.Embedding(layer.vocab, layer.width)
    if isinstance(layer, layers.RMSNorm):
        return tt.RMSNorm(shape[-1], layer.epsilon, layer.scale == "one_plus_w")
    if isinstance(layer, layers.Tokens):
        return tt.Tokens()
    if isinstance(layer, layers.ClassToken):
        return tt.ClassToken(shape[-1])
    if isinstance(layer, layers.PositionEmbedding):
        return tt.PositionEmbedding(*shape)
    if isinstance(layer, layers.SelectToken):
        return tt.SelectToken(layer.index)
    raise TypeError(f"{node.label()}: no torch translation")


class _GlobalAvgPool(nn.Module):
    def __init__(self, dims: tuple[int, ...]):
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=self.dims)


class GraphNet(nn.Module):
    """The graph's nodes in order; each value is dropped after its last reader (ResNet-50's
    activations do not all fit at once)."""

    def __init__(self, graph: Graph, fused_attention: bool = False, compiled: bool = False):
        super().__init__()
        n = len(graph.nodes)
        self.nodes = nn.ModuleList(node_module(node, i == n - 1, fused_attention) for i, node in enumerate(graph.nodes))
        if compiled:
            _pool_before_relu(graph, self.nodes)
        self.kernel_mask = kernel_mask(graph)
        self.inputs = [node.inputs for node in graph.nodes]
        self.is_add = [isinstance(node.layer, Add) for node in graph.nodes]
        self.is_multiply = [isinstance(node.layer, Multiply) for node in graph.nodes]
        #: For a tied dense layer, the index of the embedding whose table is its kernel.
        self.tied = [node.tied for node in graph.nodes]
        last_use = {j: i for i, node in enumerate(graph.nodes) for j in node.inputs}
        self.free_after = [[j for j, last in last_use.items() if last == i and j != INPUT] for i in range(n)]

    def forward(self, x: torch.Tensor, override: Any = None, last_only: bool = False) -> torch.Tensor:
        """The network on ``x``. For generation (``generation.py``): ``override(i, module, inputs)``
        gives a node's output in its module's place where it returns a tensor (attention reading its
        cache), and ``last_only`` hands the last node its inputs' last position only."""
        values: dict[int, torch.Tensor] = {INPUT: x}
        out = x
        last = len(self.nodes) - 1
        for i, mod in enumerate(self.nodes):
            ins = [values[j] for j in self.inputs[i]]
            if last_only and i == last:
                ins = [a[:, -1:] for a in ins]
            out = override(i, mod, ins) if override is not None else None
            if out is None:
                out = self._node(i, mod, ins)
            values[i] = out
            for j in self.free_after[i]:
                del values[j]
        return out

    def _node(self, i: int, mod: nn.Module, ins: list[torch.Tensor]) -> torch.Tensor:
        """Node ``i``'s output from its inputs: a sum or product of them, a tied dense layer on its
        embedding's table, or its module on its one input."""
        if self.is_add[i]:
            total = ins[0]
            for other in ins[1:]:
                total = total + other
            return mod(total)
        if self.is_multiply[i]:
            product = ins[0]
            for other in ins[1:]:
                product = product * other
            return mod(product)
        if self.tied[i] is not None:  # one table, read by the embedding and by this layer
            return mod[1](mod[0](ins[0], self.nodes[self.tied[i]].table))
        return mod(ins[0])

    # --- the weights, node by node, in the canonical list's order ---------------------------------
    def arrays(self) -> list[torch.Tensor]:
        """Every weight tensor (parameters and moving statistics) in canonical order (NCHW layouts)."""
        return [t for mod in self.nodes for t in _arrays(mod)]

    def kernels(self) -> list[torch.Tensor]:
        """What weight decay reaches, by the canonical ``model.kernel_mask``: conv, dense and
        attention kernels (the attention's as views of its ``nn.Linear`` weights), not biases,
        norms, the class token or the position embedding."""
        return [t for t, kernel in zip(self.arrays(), self.kernel_mask) if kernel]

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
            for i, (t, a) in enumerate(zip(targets, arrays)):
                if tuple(t.shape) != a.shape:  # copy_ would broadcast
                    raise ValueError(f"weight array {i}: the network's is {tuple(t.shape)}; got {a.shape}")
                t.copy_(torch.from_numpy(a))


def _pool_before_relu(graph: Graph, nodes: nn.ModuleList) -> None:
    """For torch.compile: a max pool whose one input is a ReLU's output pools first and applies the
    ReLU after it. torch 2.13's inductor on a CPU computes zero gradients for every weight before
    a ReLU followed by a max pool (conv -> relu -> max pool: cifar10's four convolutions did not
    train; eager and ``aot_eager`` are right; ``tests/test_torch_compile_grads.py`` checks). The two orders
    are the same function, value and gradient: ReLU is monotonic, so it commutes with a max (the
    pool's -inf padding included), and both send a window's gradient to its largest input."""
    readers: dict[int, int] = {}
    for node in graph.nodes:
        for j in node.inputs:
            readers[j] = readers.get(j, 0) + 1
    for i, node in enumerate(graph.nodes):
        if not isinstance(node.layer, MaxPool2D) or len(node.inputs) != 1 or node.inputs[0] == INPUT:
            continue
        j = node.inputs[0]
        before = nodes[j]
        if readers[j] != 1:
            continue
        if isinstance(before, nn.ReLU):  # an activation layer of its own
            nodes[j] = nn.Identity()
        elif isinstance(before, nn.Sequential) and isinstance(before[-1], nn.ReLU):  # a layer's activation
            before[-1] = nn.Identity()
        else:
            continue
        nodes[i] = nn.Sequential(nodes[i], nn.ReLU())


def _arrays(mod: nn.Module) -> list[torch.Tensor]:
    """``mod``'s weights in canonical order: a transformer module's own ``arrays()``; conv and
    dense ``weight, bias``; batchnorm's four; layernorm's ``weight, bias`` (gamma, beta)."""
    if isinstance(mod, tt.WEIGHTED):
        return mod.arrays()
    if isinstance(mod, (nn.Conv2d, nn.Linear)):
        return [mod.weight] + ([mod.bias] if mod.bias is not None else [])
    if isinstance(mod, BatchNormKeras):
        return [mod.weight, mod.bias, mod.running_mean, mod.running_var]
    if isinstance(mod, nn.LayerNorm):
        return [mod.weight, mod.bias]
    return [t for child in mod.children() for t in _arrays(child)]


def count(net: Optional[GraphNet]) -> int:
    return 0 if net is None else sum(t.numel() for t in net.arrays())
