"""The transformer layers of the resolved graph in Keras 3 (tensorflow, keras-jax, keras-torch).

Imports no framework: :func:`keras3_kit` takes the caller's ``keras`` module. Each layer takes the
canonical arrays (``model.py``) through ``set_weights`` and returns them through ``get_weights``,
so ``KerasNet.set``/``get`` stay layer by layer. The conversions from the canonical conventions:

- ``tokens``: ``Reshape((H*W, C))`` (row-major over (h, w), as the reference);
- ``class_token`` (``(d,)``, prepended as token 0) and ``position_embedding`` (``(T, d)``, added):
  small layers holding the canonical array as it is;
- ``layernorm``: ``LayerNormalization(epsilon=<the spec's>)``, never Keras' 1e-3; under a mixed
  policy it normalizes in float32 (Keras' own ``autocast=False``);
- ``attention``: ``MultiHeadAttention(heads, key_dim=head_dim, output_shape=d)``, which scales the
  scores by 1/sqrt(key_dim) (the reference's 1/sqrt(head_dim)), takes the softmax over the keys and
  has no attention dropout (rate 0). Its per-head kernels are the canonical heads-major columns
  reshaped (:func:`attention_to_keras`): q/k/v ``(d, heads, head_dim)`` and biases
  ``(heads, head_dim)``, the output kernel ``(heads, head_dim, d)``; its weights come in the
  canonical order (query, key, value, output; kernel then bias). heads * head_dim may differ from d;
- GELU: ``keras.activations.gelu(x, approximate=...)`` with the spec's ``approximate`` (False unless
  it says so); ``keras.ops.gelu`` defaults to the tanh form and is never used bare;
- the decoder's layers (``embedding``, ``rmsnorm``, an attention with a causal mask, grouped
  key/value heads, rotary positions or no biases, a dense ``tied_to`` an embedding): ``decoder.py``;
- ``select_token``: the token at ``index``; ``global_avgpool`` over tokens: ``GlobalAveragePooling1D``
  (``keras_layers``); ``dense``, ``dropout``, ``add`` take tokens as they are.

Under a mixed dtype policy (tensorflow's bf16) every layer follows Keras' policy: bfloat16 compute,
float32 variables; layernorm and the attention's softmax computed in float32 by Keras itself.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ...spec.graph import Node
from ...spec.layers import Attention, ClassToken, Embedding, LayerNorm, PositionEmbedding, RMSNorm, SelectToken, Tokens
from .decoder import decoder_classes, tied_dense


def attention_to_keras(arrays: Sequence[np.ndarray], heads: int, head_dim: int) -> list[np.ndarray]:
    """The canonical eight arrays as ``MultiHeadAttention``'s per-head ones: column
    ``i * head_dim + j`` of a q/k/v kernel is dimension j of head i (heads major)."""
    out = []
    for j, a in enumerate(arrays):
        a = np.asarray(a)
        if j < 6:  # q/k/v kernels (d, heads*head_dim) and biases (heads*head_dim,)
            out.append(a.reshape(*a.shape[:-1], heads, head_dim))
        elif j == 6:  # output kernel (heads*head_dim, d)
            out.append(a.reshape(heads, head_dim, a.shape[-1]))
        else:
            out.append(a)
    return out


def attention_from_keras(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Inverse of :func:`attention_to_keras`."""
    out = []
    for j, a in enumerate(arrays):
        a = np.asarray(a)
        if j < 6:
            out.append(a.reshape(*a.shape[:-2], a.shape[-2] * a.shape[-1]))
        elif j == 6:
            out.append(a.reshape(a.shape[0] * a.shape[1], a.shape[2]))
        else:
            out.append(a)
    return out


def gelu(keras: Any, approximate: bool) -> Callable[[Any], Any]:
    """GELU in the spec's form: ``keras.activations.gelu`` with ``approximate`` passed explicitly."""
    return functools.partial(keras.activations.gelu, approximate=approximate)


@functools.lru_cache(maxsize=None)
def _classes(keras: Any) -> Any:
    """The Keras 3 layer classes of this module, made once per ``keras`` module."""
    ops = keras.ops

    class ClassTokenLayer(keras.layers.Layer):
        """A learned token ``(d,)`` prepended to the sequence (token 0)."""

        def build(self, input_shape: Any) -> None:
            self.token = self.add_weight(shape=(input_shape[-1],), initializer="zeros", name="token")

        def call(self, x: Any) -> Any:
            # zeros_like + broadcast instead of broadcast_to a dynamic batch size: every backend traces it
            return ops.concatenate([ops.zeros_like(x[:, :1]) + self.token, x], axis=1)

        def compute_output_shape(self, input_shape: Any) -> Any:
            n, t, d = input_shape
            return (n, None if t is None else t + 1, d)

    class PositionEmbeddingLayer(keras.layers.Layer):
        """A learned ``(T, d)`` table added to the sequence."""

        def build(self, input_shape: Any) -> None:
            self.table = self.add_weight(shape=tuple(input_shape[1:]), initializer="zeros", name="table")

        def call(self, x: Any) -> Any:
            return x + self.table

        def compute_output_shape(self, input_shape: Any) -> Any:
            return input_shape

    class SelectTokenLayer(keras.layers.Layer):
        """(N, T, d) -> (N, d): the token at ``index``."""

        def __init__(self, index: int = 0, **kwargs: Any):
            super().__init__(**kwargs)
            self.index = index

        def call(self, x: Any) -> Any:
            return x[:, self.index]

        def compute_output_shape(self, input_shape: Any) -> Any:
            return (input_shape[0], input_shape[2])

    class CanonicalAttention(keras.layers.MultiHeadAttention):
        """Keras' self-attention whose ``set_weights``/``get_weights`` speak the canonical layout."""

        def set_weights(self, weights: Sequence[Any]) -> None:
            super().set_weights(attention_to_keras(weights, self.num_heads, self.key_dim))

        def get_weights(self) -> list[Any]:
            return attention_from_keras(super().get_weights())

    return type("Keras3Classes", (), dict(ClassToken=ClassTokenLayer, PositionEmbedding=PositionEmbeddingLayer,
                                          SelectToken=SelectTokenLayer, Attention=CanonicalAttention))


def keras3_kit(keras: Any, dtype: Optional[str] = None) -> "Keras3Transformer":
    """The transformer layers for :func:`keras_layers.build` in Keras 3, made under ``dtype`` (a
    dtype policy name; None: Keras' default)."""
    return Keras3Transformer(keras, dtype)


class Keras3Transformer:
    """Builds the token layers of the graph (``layers.TOKEN_LAYERS``) and resolves GELU."""

    def __init__(self, keras: Any, dtype: Optional[str] = None):
        self.keras, self.dtype = keras, dtype

    def gelu(self, approximate: bool) -> Callable[[Any], Any]:
        return gelu(self.keras, approximate)

    def layer(self, node: Node, x: Any, L: Any, reg: Any) -> tuple[Any, Any]:
        """(output tensor, the layer holding the node's weights or None). ``L``: the layers
        namespace (under the policy); ``reg``: the L2 kernel regularizer or None."""
        layer, kw = node.layer, {} if self.dtype is None else {"dtype": self.dtype}
        cls = _classes(self.keras)
        if isinstance(layer, Tokens):
            h, w, c = node.in_shape
            return L.Reshape((h * w, c))(x), None
        if isinstance(layer, ClassToken):
            holder = cls.ClassToken(**kw)
            return holder(x), holder
        if isinstance(layer, PositionEmbedding):
            holder = cls.PositionEmbedding(**kw)
            return holder(x), holder
        if isinstance(layer, LayerNorm):
            holder = L.LayerNormalization(axis=-1, epsilon=layer.epsilon)
            return holder(x), holder
        if isinstance(layer, Embedding):
            holder = decoder_classes(self.keras).Embedding(layer.vocab, layer.width, **kw)
            return holder(x), holder
        if isinstance(layer, RMSNorm):
            holder = decoder_classes(self.keras).RMSNorm(layer.epsilon, layer.scale == "one_plus_w", **kw)
            return holder(x), holder
        if isinstance(layer, Attention) and is_decoder_attention(layer):
            rope = None if layer.rope is None else (layer.rope.base, layer.rope.pairing)
            holder = decoder_classes(self.keras).Attention(layer.heads, layer.head_dim, layer.groups, layer.causal,
                                                           rope, layer.use_bias, kernel_regularizer=reg, **kw)
            return holder(x), holder
        if isinstance(layer, Attention):
            holder = cls.Attention(layer.heads, layer.head_dim, output_shape=node.in_shape[-1], dropout=0.0,
                                   kernel_regularizer=reg, **kw)
            return holder(x, x), holder
        if isinstance(layer, SelectToken):
            return cls.SelectToken(layer.index, **kw)(x), None
        raise TypeError(f"{node.label()}: no Keras translation")

    def tied(self, node: Node, x: Any, embedding: Any, act: Any) -> tuple[Any, Any]:
        """A dense layer tied to ``embedding`` (the embedding node's holder): (output, the layer
        holding its bias, or None without one)."""
        kw = {} if self.dtype is None else {"dtype": self.dtype}
        holder = tied_dense(self.keras, embedding, node.layer.units, node.layer.use_bias, act, **kw)
        return holder(x), holder if node.layer.use_bias else None


def is_decoder_attention(layer: Attention) -> bool:
    """Whether an attention layer asks for what Keras' ``MultiHeadAttention`` cannot do (a causal
    mask, grouped key/value heads, rotary positions, no biases): ``decoder.DecoderAttention`` builds it."""
    return layer.causal or layer.groups != layer.heads or layer.rope is not None or not layer.use_bias
