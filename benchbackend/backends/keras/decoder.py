"""The decoder layers of the resolved graph in Keras 3 (tensorflow, keras-jax, keras-torch), in
``keras.ops`` only, so one definition runs on all three backends.

Imports no framework: :func:`decoder_classes` takes the caller's ``keras`` module. Keras' own
``MultiHeadAttention`` has no rotary positions and no grouped key/value heads, so a decoder's
attention is :class:`DecoderAttention` below, holding the canonical arrays as they are (``model.py``):
q, k, v, o kernels ``(d, heads*head_dim)``, ``(d, kv_heads*head_dim)`` twice, ``(heads*head_dim, d)``,
each followed by its bias unless ``use_bias: false``; ``set_weights``/``get_weights`` take and give
them in that order (the order ``build`` creates them in). The conventions, as the reference's
(``backends/numpy/transformer.py``):

- ``embedding``: the ids arrive as float32 whole numbers; the layer casts them to int32 and takes
  the table's rows (``autocast=False``: under a mixed policy the ids are never rounded to bfloat16);
- ``rmsnorm``: ``x / sqrt(mean(x^2) + epsilon) * s``, ``s = w`` or ``1 + w`` (:func:`rms_scale`),
  computed in float32 whatever the policy, output in the compute dtype (as Keras' LayerNormalization);
- attention: the heads split heads-major (column ``i * head_dim + j`` is head i's dimension j);
  rotary positions (:func:`rope_tables`, :func:`rope_rotate`) on q and k after their projection,
  at positions 0..T-1; key/value head ``h // (heads // kv_heads)`` for query head h
  (:func:`repeat_kv`, blocks); scores ``q k^T / sqrt(head_dim)`` in the compute dtype, then
  cast to float32 for the causal mask (:func:`causal_mask`: key j <= query i, as -inf) and the
  softmax over the keys (:func:`softmax`), the probabilities cast back to the compute dtype for
  ``p v`` (Hugging Face's Llama under bf16 does the same). On the test traps a softmax in bfloat16
  moves the output by less than bf16's own rounding elsewhere (``tests/test_decoder_keras.py``);
- a tied dense (:class:`TiedDense`): ``x @ table^T (+ bias)`` reading the embedding layer's own
  variable, never a copy (the layer does not track the embedding, so the variable is the model's
  once; its gradient sums both uses). Its weights are its bias alone, if any.

The module-level functions are what the layers call at trace time, so a test can plant a wrong
convention by replacing one of them.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import numpy as np


def rope_tables(tokens: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each (T, head_dim/2) float32: position p, pair i turns by ``p * base ** (-2i / head_dim)``."""
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angle = np.outer(np.arange(tokens, dtype=np.float64), inv_freq)
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def rope_rotate(ops: Any, a: Any, cos: Any, sin: Any, pairing: str) -> Any:
    """Queries or keys (N, heads, T, head_dim) turned by their positions: pairs (i, i + head_dim/2)
    for ``half``, (2i, 2i + 1) for ``interleaved``."""
    heads, tokens, head_dim = a.shape[1], a.shape[2], a.shape[3]
    if pairing == "half":
        half = head_dim // 2
        x1, x2 = a[..., :half], a[..., half:]
        return ops.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    pairs = ops.reshape(a, (-1, heads, tokens, head_dim // 2, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    turned = ops.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return ops.reshape(turned, (-1, heads, tokens, head_dim))


def causal_mask(tokens: int) -> np.ndarray:
    """(T, T) bool: query i may read key j (j <= i)."""
    return np.tril(np.ones((tokens, tokens), dtype=bool))


def repeat_kv(ops: Any, a: Any, share: int) -> Any:
    """Key/value heads (N, kv_heads, T, head_dim) as (N, heads, T, head_dim): each one repeated for
    the ``share`` consecutive query heads of its block."""
    return a if share == 1 else ops.repeat(a, share, axis=1)


def softmax(ops: Any, scores: Any, dtype: str) -> Any:
    """The softmax over the keys in float32, returned in ``dtype`` (the compute dtype)."""
    return ops.cast(ops.softmax(ops.cast(scores, "float32"), axis=-1), dtype)


def rms_scale(w: Any, one_plus: bool) -> Any:
    """RMSNorm's scale from its weight: ``1 + w`` (``one_plus_w``) or ``w``."""
    return 1.0 + w if one_plus else w


@functools.lru_cache(maxsize=None)
def decoder_classes(keras: Any) -> Any:
    """The Keras 3 decoder layer classes, made once per ``keras`` module."""
    ops = keras.ops
    Layer = keras.layers.Layer

    class TokenEmbedding(Layer):
        """(N, T) float ids -> (N, T, width): rows of a (vocab, width) table."""

        def __init__(self, vocab: int, width: int, **kwargs: Any):
            super().__init__(autocast=False, **kwargs)
            self.vocab, self.width = vocab, width

        def build(self, input_shape: Any) -> None:
            self.table = self.add_weight(shape=(self.vocab, self.width), name="table",
                                         initializer=keras.initializers.RandomNormal(stddev=0.02))

        def call(self, ids: Any) -> Any:
            rows = ops.take(self.table, ops.cast(ids, "int32"), axis=0)
            return ops.cast(rows, self.compute_dtype)

        def compute_output_shape(self, input_shape: Any) -> Any:
            return (*input_shape, self.width)

    class RMSNormLayer(Layer):
        """``x / sqrt(mean(x^2) + epsilon) * s`` over the last axis, in float32."""

        def __init__(self, epsilon: float, one_plus: bool, **kwargs: Any):
            super().__init__(autocast=False, **kwargs)
            self.epsilon, self.one_plus = epsilon, one_plus

        def build(self, input_shape: Any) -> None:
            self.w = self.add_weight(shape=(input_shape[-1],), initializer="zeros" if self.one_plus else "ones",
                                     name="scale")

        def call(self, x: Any) -> Any:
            x = ops.cast(x, "float32")
            xhat = x * ops.rsqrt(ops.mean(ops.square(x), axis=-1, keepdims=True) + self.epsilon)
            return ops.cast(xhat * rms_scale(ops.cast(self.w, "float32"), self.one_plus), self.compute_dtype)

        def compute_output_shape(self, input_shape: Any) -> Any:
            return input_shape

    class DecoderAttention(Layer):
        """Self-attention with the decoder's options, on the canonical arrays."""

        def __init__(self, heads: int, head_dim: int, kv_heads: int, causal: bool, rope: Optional[tuple[float, str]],
                     use_bias: bool, kernel_regularizer: Any = None, **kwargs: Any):
            super().__init__(**kwargs)
            self.heads, self.head_dim, self.kv_heads = heads, head_dim, kv_heads
            self.causal, self.rope, self.use_bias, self.reg = causal, rope, use_bias, kernel_regularizer

        def build(self, input_shape: Any) -> None:
            d = input_shape[-1]
            inner, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            self.projections = []
            for name, shape in (("query", (d, inner)), ("key", (d, kv)), ("value", (d, kv)), ("output", (inner, d))):
                kernel = self.add_weight(shape=shape, initializer="glorot_uniform", regularizer=self.reg,
                                         name=f"{name}_kernel")
                bias = self.add_weight(shape=(shape[1],), initializer="zeros", name=f"{name}_bias") \
                    if self.use_bias else None
                self.projections.append((kernel, bias))

        def _project(self, x: Any, j: int) -> Any:
            kernel, bias = self.projections[j]
            y = ops.matmul(x, kernel)
            return y if bias is None else y + bias

        def _split(self, a: Any, heads: int, tokens: int) -> Any:
            return ops.transpose(ops.reshape(a, (-1, tokens, heads, self.head_dim)), (0, 2, 1, 3))

        def call(self, x: Any) -> Any:
            tokens = x.shape[1]
            q = self._split(self._project(x, 0), self.heads, tokens)
            k = self._split(self._project(x, 1), self.kv_heads, tokens)
            v = self._split(self._project(x, 2), self.kv_heads, tokens)
            if self.rope is not None:
                base, pairing = self.rope
                cos, sin = (ops.cast(ops.convert_to_tensor(t), q.dtype) for t in rope_tables(tokens, self.head_dim,
                                                                                              base))
                q, k = rope_rotate(ops, q, cos, sin, pairing), rope_rotate(ops, k, cos, sin, pairing)
            share = self.heads // self.kv_heads
            k, v = repeat_kv(ops, k, share), repeat_kv(ops, v, share)
            scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) * ops.cast(1.0 / math.sqrt(self.head_dim),
                                                                               q.dtype)
            scores = ops.cast(scores, "float32")  # the mask and the softmax in float32 (Hugging Face's too)
            if self.causal:
                scores = ops.where(ops.convert_to_tensor(causal_mask(tokens)), scores, float("-inf"))
            p = softmax(ops, scores, self.compute_dtype)
            mixed = ops.reshape(ops.transpose(ops.matmul(p, v), (0, 2, 1, 3)), (-1, tokens, self.heads * self.head_dim))
            return self._project(mixed, 3)

        def compute_output_shape(self, input_shape: Any) -> Any:
            return input_shape

    class TiedDense(Layer):
        """``x @ table^T (+ bias)``: the kernel is the embedding layer's table, read, not copied."""

        def __init__(self, embedding: Any, units: int, use_bias: bool, activation: Any = None, **kwargs: Any):
            super().__init__(**kwargs)
            self.embedding = lambda: embedding  # a function: Keras does not track the layer (one variable)
            self.units, self.use_bias = units, use_bias
            self.activation = keras.activations.get(activation)

        def build(self, input_shape: Any) -> None:
            self.bias = self.add_weight(shape=(self.units,), initializer="zeros", name="bias") \
                if self.use_bias else None

        def call(self, x: Any) -> Any:
            table = ops.cast(self.embedding().table, self.compute_dtype)
            y = ops.matmul(x, ops.transpose(table))
            if self.bias is not None:
                y = y + self.bias
            return self.activation(y)

        def compute_output_shape(self, input_shape: Any) -> Any:
            return (*input_shape[:-1], self.units)

    return type("KerasDecoderClasses", (), dict(Embedding=TokenEmbedding, RMSNorm=RMSNormLayer,
                                                Attention=DecoderAttention, TiedDense=TiedDense))


def tied_dense(keras: Any, embedding: Any, units: int, use_bias: bool, activation: Any,
               **kwargs: Any) -> Callable[[Any], Any]:
    """A dense layer whose kernel is ``embedding``'s table (an embedding layer of this module), transposed."""
    return decoder_classes(keras).TiedDense(embedding, units, use_bias, activation, **kwargs)
