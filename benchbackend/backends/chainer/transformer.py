"""The transformer layers (``layers.TOKEN_LAYERS``, GELU, dense/avgpool on tokens) as Chainer links and
functions, on the canonical weights of ``benchbackend.spec.model``; token sequences are (N, T, d), batch first.

Where Chainer's defaults differ from the reference's conventions, this module converts:

- tokens: the conv's NCHW output is transposed to NHWC before the reshape, so tokens run over (h, w)
  row-major with the channels last, as the reference's NHWC reshape;
- layernorm (:class:`LayerNorm`): ``F.layer_normalization`` (2-D input, biased variance) on the tokens
  reshaped to (N*T, d), with the spec's epsilon (``L.LayerNormalization`` defaults to 1e-6);
- attention: ``decoder.Attention`` (the ViT's is its case without causal mask, RoPE or grouped heads);
- GELU (:func:`gelu`): exact ``x * Phi(x)`` by default; tanh form only when the spec asks. Chainer's
  ``F.erf`` on the CPU is ``numpy.vectorize(math.erf)`` without SciPy (one Python call per element:
  the Chainer environment has no SciPy), so the exact form is a function node of its own, on
  ``scipy.special.erfc`` where SciPy imports and else on a rational approximation of erfc (relative
  error below 1.2e-7, float32's resolution).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import chainer
import chainer.functions as F
import numpy as np
from chainer import backend, function_node
from chainer.backends import cuda

from ...spec import layers
from ...spec.graph import Node

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
Op = Callable[[list, Any], Any]


# --- GELU ------------------------------------------------------------------------------------
def _erfcc(z: np.ndarray) -> np.ndarray:
    """erfc in float64: Numerical Recipes' ``erfcc`` (Chebyshev fit; relative error below 1.2e-7)."""
    a = np.abs(z)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = 0.17087277
    for c in (-0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806, 0.09678418, 0.37409196,
              1.00002368, -1.26551223):
        poly = c + t * poly
    r = t * np.exp(-a * a + poly)
    return np.where(z >= 0, r, 2.0 - r)


try:
    from scipy.special import erfc as _erfc_numpy
except ImportError:
    _erfc_numpy = _erfcc


def _phi(x: Any) -> Any:
    """The standard normal CDF, ``0.5 * erfc(-x / sqrt 2)`` (full relative precision for x << 0), in x's dtype."""
    if backend.get_array_module(x) is np:
        return (0.5 * _erfc_numpy(-x.astype(np.float64) / math.sqrt(2.0))).astype(x.dtype)
    return cuda.elementwise("T x", "T y", "y = 0.5 * erfc(-x * M_SQRT1_2)", "benchbackend_phi")(x)


class _GeluExact(function_node.FunctionNode):
    """``x * Phi(x)``; its gradient is a node of its own, so ``static_graph`` records it in the backward schedule."""

    def forward(self, inputs: tuple) -> tuple:
        self.retain_inputs((0,))
        x, = inputs
        return x * _phi(x),

    def backward(self, indexes: Any, grad_outputs: tuple) -> tuple:
        x, = self.get_retained_inputs()
        return _GeluExactGrad().apply((x, grad_outputs[0]))


class _GeluExactGrad(function_node.FunctionNode):
    def forward(self, inputs: tuple) -> tuple:
        x, gy = inputs
        xp = backend.get_array_module(x)
        pdf = xp.exp(-0.5 * x * x) * x.dtype.type(_INV_SQRT_2PI)
        return gy * (_phi(x) + x * pdf),


def gelu(x: Any, approximate: bool = False) -> Any:
    """Exact ``x * Phi(x)``; approximate: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    if approximate:
        return 0.5 * x * (1.0 + F.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))
    return _GeluExact().apply((x,))[0]


# --- layers ----------------------------------------------------------------------------------
class TokenLink(chainer.Chain):
    """A transformer layer that holds weights: ``arrays`` in canonical order, ``TRANSPOSED`` per array
    (the chain's array is the canonical one transposed), ``kernels`` (what weight decay reaches)."""

    TRANSPOSED: tuple[bool, ...] = ()

    def arrays(self) -> list[Any]:
        raise NotImplementedError

    def kernels(self) -> list[Any]:
        return []


class ClassToken(TokenLink):
    TRANSPOSED = (False,)

    def __init__(self, d: int):
        super().__init__()
        with self.init_scope():
            self.token = chainer.Parameter(np.zeros(d, np.float32))

    def forward(self, x: Any) -> Any:
        n, _, d = x.shape
        token = F.broadcast_to(F.reshape(self.token, (1, 1, d)), (n, 1, d))
        return F.concat([token, x], axis=1)

    def arrays(self) -> list[Any]:
        return [self.token.array]


class PositionEmbedding(TokenLink):
    TRANSPOSED = (False,)

    def __init__(self, t: int, d: int):
        super().__init__()
        with self.init_scope():
            self.table = chainer.Parameter(np.zeros((t, d), np.float32))

    def forward(self, x: Any) -> Any:
        return x + self.table  # broadcast over the batch; its gradient sums over it

    def arrays(self) -> list[Any]:
        return [self.table.array]


class LayerNorm(TokenLink):
    TRANSPOSED = (False, False)

    def __init__(self, d: int, epsilon: float):
        super().__init__()
        with self.init_scope():
            self.gamma = chainer.Parameter(np.ones(d, np.float32))
            self.beta = chainer.Parameter(np.zeros(d, np.float32))
        self.eps = epsilon

    def forward(self, x: Any) -> Any:
        flat = F.reshape(x, (-1, x.shape[-1]))
        return F.reshape(F.layer_normalization(flat, self.gamma, self.beta, eps=self.eps), x.shape)

    def arrays(self) -> list[Any]:
        return [self.gamma.array, self.beta.array]


def tokens(x: Any) -> Any:
    """NCHW (N, C, H, W) -> (N, H*W, C), tokens row-major over (h, w) as the reference's NHWC reshape."""
    n, c, h, w = x.shape
    return F.reshape(F.transpose(x, (0, 2, 3, 1)), (n, h * w, c))


def token_op(node: Node) -> tuple[Any, Op]:
    """(the link holding ``node``'s weights or None, its op) for a layer of ``layers.TOKEN_LAYERS``."""
    layer = node.layer
    if isinstance(layer, layers.Tokens):
        return None, lambda ins, masks: tokens(ins[0])
    if isinstance(layer, layers.SelectToken):
        return None, lambda ins, masks: ins[0][:, layer.index]
    t, d = node.in_shape
    link: TokenLink
    if isinstance(layer, layers.ClassToken):
        link = ClassToken(d)
    elif isinstance(layer, layers.PositionEmbedding):
        link = PositionEmbedding(t, d)
    elif isinstance(layer, layers.LayerNorm):
        link = LayerNorm(d, layer.epsilon)
    else:
        raise TypeError(f"{node.label()}: no Chainer translation")
    return link, lambda ins, masks: link(ins[0])
