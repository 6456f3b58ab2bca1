"""Greedy generation with a static key/value cache for the Keras 3 family (tensorflow, keras-jax,
keras-torch): one cached forward in ``keras.ops`` over the built model's own variables.

:class:`CachedForward` walks the resolved graph (``KerasNet``: a node and the Keras layer holding its
weights) on the new tokens only. Per-token layers (embedding, norms, dense, activations, add,
multiply) are the model's own layers, called on (B, T) tokens, so their weights and their dtype
policy are the model's (no second copy of any weight); what depends on the position is computed
here from the layers' variables:

- attention (``decoder.DecoderAttention``'s arrays): q, k, v projected for the new tokens, rotary
  angles of their absolute positions (rows ``start..start+T-1`` of :func:`decoder.rope_tables` over
  the cache's positions), k and v written into the cache at ``start``, then the queries read the
  cache: in the prompt pass (``start`` 0) positions 0..T-1 under :func:`decoder.causal_mask`, in a
  decode step (T = 1) every cache position under the mask ``key <= start`` (positions not yet
  written, or left over from an earlier pass, are masked). Grouped key/value heads in blocks
  (:func:`decoder.repeat_kv`), the softmax in float32 (:func:`decoder.softmax`), as the layer does;
- a learned position embedding adds its rows ``start..start+T-1`` (the reference's prefix);
- the output layer runs on the last position only and its softmax is skipped (greedy: the argmax of
  the logits is the argmax of the probabilities, and a float32 softmax could only add ties).

The cache is ``(B, kv_heads, positions, head_dim)`` per layer, keys and values apart, in the
workload's ``generating.cache`` element type (fp32 unless the spec says otherwise, at every
precision): the new keys and values are cast to it when written, and read back in the compute
dtype. The decoder module's functions are looked up at call time, so a test can plant a wrong
convention by replacing one of them (as ``tests/test_decoder_keras.py`` does).

How each framework runs it, the way it compiles elsewhere in its adapter:

- tensorflow: ``tf.function``s; the cache is ``tf.Variable``s written in place (a strided-slice
  assign at a tensor ``start``). The decode step has a fixed input signature (ids (B,) int32,
  position () int32) and is traced in ``start``; the prompt pass is traced at its first call (its
  shape is not known before), once per ``start``. ``jit_compile`` follows the adapter's mode (XLA).
- keras-jax: ``jax.jit`` over the variables' values (``keras.StatelessScope`` maps each variable to
  its traced value: the weights are arguments, not constants), the cache a functional array updated
  by ``keras.ops.slice_update`` (``lax.dynamic_update_slice``) and donated, so XLA updates it in
  place. The decode step is compiled in ``start`` by one step (:func:`warm_up`), the prompt pass at
  its first call. (Not by ``lower().compile()``: the ``Compiled`` it returns is called through
  Python, not ``jax.jit``'s C++ dispatch. Called so, gpt-nano B=1 decoded at 1.3 ms per token on an
  H100, no faster than its 64-token prompt pass; the step through ``jax.jit`` is not measured there yet.)
- keras-torch: a plain eager call through ``keras.ops`` under ``torch.no_grad`` (Keras on torch
  compiles nothing by default, as its ``fit`` runs eagerly too), the cache written in place by
  indexing.

All prompts of a batch have one length (no padding). Frameworks are imported inside the functions
that need them: this module is imported only by the adapters of the Keras family.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from ...spec.graph import INPUT
from ...spec.layers import (
    ActivationLayer,
    Add,
    Attention,
    Dense,
    Dropout,
    Multiply,
    PositionEmbedding,
)
from . import decoder
from .layers import KerasNet, _act
from .transformer import keras3_kit

#: The cache's element type (``generating.cache``) as a Keras dtype, and its size in bytes.
CACHE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


class CachedForward:
    """The network's forward on new tokens at positions ``start..start+T-1``, reading and writing a
    key/value cache; framework-neutral (``keras.ops`` and the model's own layers)."""

    def __init__(self, keras: Any, net: KerasNet, positions: int):
        self.keras, self.ops, self.net, self.positions = keras, keras.ops, net, positions
        self.kit = keras3_kit(keras)
        self.attention = [(node, holder) for node, holder in zip(net.graph.nodes, net.holders)
                          if isinstance(node.layer, Attention)]
        self.slot = {node.index: i for i, (node, _) in enumerate(self.attention)}  # node -> cache index
        self.dtype = self.attention[0][1].compute_dtype  # the policy's compute dtype (bfloat16 when mixed)
        # Under a float32 policy a layer's ``call`` is its ``__call__``: what ``__call__`` adds (input
        # casts, the variables' autocast, name scopes, symbolic checks) does nothing there, and it took
        # half of keras-torch's eager decode step (gpt-nano, CPU). Under a mixed policy, ``__call__``.
        self.direct = all(h.compute_dtype == h.variable_dtype == "float32" for h in net.holders if h is not None)
        self.rope: dict[int, tuple[Any, Any]] = {}
        for node, holder in self.attention:  # rotary tables over every cache position, once
            if holder.rope is not None:
                cos, sin = decoder.rope_tables(positions, holder.head_dim, holder.rope[0])
                self.rope[node.index] = (self.ops.convert_to_tensor(cos), self.ops.convert_to_tensor(sin))

    def cache_shapes(self, batch: int) -> list[tuple[int, int, int, int]]:
        """(B, kv_heads, positions, head_dim) of each attention layer's key (and value) array."""
        return [(batch, h.kv_heads, self.positions, h.head_dim) for _, h in self.attention]

    def __call__(self, ids: Any, start: Any, cache: Any, prefill: bool) -> Any:
        """Greedy next ids (B,) int32 after ``ids`` (B, T) int32 at positions ``start..start+T-1``
        (``prefill``: the prompt, ``start`` 0; otherwise one token, T = 1);
        ``cache.write(i, k, v, start)`` stores layer i's new keys and values and returns its whole
        (keys, values)."""
        ops, graph = self.ops, self.net.graph
        values: dict[int, Any] = {INPUT: ids}
        for node, holder in zip(graph.nodes, self.net.holders):
            ins = [values[j] for j in node.inputs]
            layer, x = node.layer, ins[0]
            if node is graph.output:
                values[node.index] = self._logits(node, holder, x[:, -1])
            elif isinstance(layer, Attention):
                values[node.index] = self._attend(node, holder, x, start, cache, prefill)
            elif isinstance(layer, PositionEmbedding):
                values[node.index] = x + ops.cast(rows(ops, holder.table, start, x.shape[1]), x.dtype)
            elif isinstance(layer, Dense) and node.tied is not None:
                values[node.index] = self._tied(node, holder, x, self._act(node))
            elif isinstance(layer, Add):
                total = ins[0]
                for other in ins[1:]:
                    total = total + other
                act = self._act(node)
                values[node.index] = total if act is None else self.keras.activations.get(act)(total)
            elif isinstance(layer, Multiply):
                product = ins[0]
                for other in ins[1:]:
                    product = product * other
                values[node.index] = product
            elif isinstance(layer, Dropout):
                values[node.index] = x
            elif isinstance(layer, ActivationLayer):
                act = self._act(node)
                values[node.index] = x if act is None else self.keras.activations.get(act)(x)
            elif holder is not None:  # embedding, rmsnorm, layernorm, dense: the model's own layer
                values[node.index] = holder.call(x) if self.direct else holder(x)
            else:
                raise TypeError(f"{node.label()}: no cached forward in Keras")
        return ops.cast(ops.argmax(values[graph.output.index], axis=-1), "int32")

    def _act(self, node: Any) -> Optional[Any]:
        return _act(node.activation, node.layer, self.kit)

    def _tied(self, node: Any, holder: Any, x: Any, act: Any) -> Any:
        """``x @ table^T (+ bias)`` on the embedding's own table, in the compute dtype."""
        ops = self.ops
        table = self.net.holders[node.tied].table
        y = ops.matmul(ops.cast(x, self.dtype), ops.transpose(ops.cast(table, self.dtype)))
        if holder is not None and holder.bias is not None:
            y = y + ops.cast(holder.bias, self.dtype)
        return y if act is None else self.keras.activations.get(act)(y)

    def _logits(self, node: Any, holder: Any, x: Any) -> Any:
        """The output layer at one position (B, d) -> (B, units), its softmax skipped."""
        ops = self.ops
        act = None if node.activation in ("softmax", "none") else self._act(node)
        if node.tied is not None:
            return self._tied(node, holder, x, act)
        y = ops.matmul(ops.cast(x, self.dtype), ops.cast(holder.kernel, self.dtype))
        if holder.bias is not None:
            y = y + ops.cast(holder.bias, self.dtype)
        return y if act is None else self.keras.activations.get(act)(y)

    def _attend(self, node: Any, layer: Any, x: Any, start: Any, cache: Any, prefill: bool) -> Any:
        ops, dt = self.ops, layer.compute_dtype
        tokens, hd = x.shape[1], layer.head_dim
        x = ops.cast(x, dt)

        def project(j: int) -> Any:
            kernel, bias = layer.projections[j]
            y = ops.matmul(x, ops.cast(kernel, dt))
            return y if bias is None else y + ops.cast(bias, dt)

        def split(a: Any, heads: int) -> Any:
            return ops.transpose(ops.reshape(a, (-1, tokens, heads, hd)), (0, 2, 1, 3))

        q, k, v = split(project(0), layer.heads), split(project(1), layer.kv_heads), split(project(2), layer.kv_heads)
        if layer.rope is not None:
            cos, sin = (ops.cast(rows(ops, t, start, tokens), dt) for t in self.rope[node.index])
            q = decoder.rope_rotate(ops, q, cos, sin, layer.rope[1])
            k = decoder.rope_rotate(ops, k, cos, sin, layer.rope[1])
        keys, vals = cache.write(self.slot[node.index], k, v, start)
        if prefill:  # the prompt's own positions, causal
            keys, vals = keys[:, :, :tokens], vals[:, :, :tokens]
            mask = ops.convert_to_tensor(decoder.causal_mask(tokens))
        else:  # every cache position up to the token's own
            mask = ops.expand_dims(ops.arange(self.positions, dtype="int32") <= start, 0)
        share = layer.heads // layer.kv_heads
        keys = decoder.repeat_kv(ops, ops.cast(keys, dt), share)
        vals = decoder.repeat_kv(ops, ops.cast(vals, dt), share)
        scores = ops.matmul(q, ops.transpose(keys, (0, 1, 3, 2))) * (1.0 / math.sqrt(hd))  # a Python scale: no tensor
        scores = ops.where(mask, ops.cast(scores, "float32"), float("-inf"))
        p = decoder.softmax(ops, scores, dt)
        mixed = ops.reshape(ops.transpose(ops.matmul(p, vals), (0, 2, 1, 3)), (-1, tokens, layer.heads * hd))
        out_kernel, out_bias = layer.projections[3]
        y = ops.matmul(mixed, ops.cast(out_kernel, dt))
        return y if out_bias is None else y + ops.cast(out_bias, dt)


# The two places a position enters (seams: the tests plant a wrong one; ``start`` is 0, a Python
# int, in the prompt pass, and a tensor or an int in a decode step).
def rows(ops: Any, table: Any, start: Any, tokens: int) -> Any:
    """Rows ``start..start+tokens-1`` of a per-position table (rotary cos/sin, position embedding)."""
    return ops.slice(ops.convert_to_tensor(table), (start, 0), (tokens, table.shape[1]))  # a variable's value


def write_at(start: Any) -> Any:
    """The cache position where the new tokens' keys and values go."""
    return start


def nbytes(arrays: list[Any]) -> int:
    """Bytes of ``arrays`` in their own element type."""
    from keras import backend

    return sum(int(np.prod(a.shape)) * ITEMSIZE[backend.standardize_dtype(a.dtype)] for a in arrays)


# --- per framework ---------------------------------------------------------------------------------
def warm_up(generator: "Generator") -> None:
    """One decode step at the last cache position, so that the step is traced and compiled (and a
    GPU's kernels loaded) before the clock. No pass reads what it writes there: a pass decodes up to
    position ``positions - 2`` (its last token is not fed back), and each step reads positions
    0..its own only, all written in the pass before it."""
    zeros = generator.keras.ops.zeros((generator.batch,), "int32")
    generator.decode(zeros, generator.positions - 1)

class Generator:
    """The adapter's generation state: the cached forward, the cache, the compiled steps."""

    def __init__(self, keras: Any, net: KerasNet, batch: int, positions: int, cache: str):
        self.keras, self.batch, self.positions = keras, batch, positions
        self.forward = CachedForward(keras, net, positions)
        self.cache_dtype = CACHE_DTYPES[cache]

    def prefill(self, ids: np.ndarray) -> Any:
        raise NotImplementedError

    def decode(self, ids: Any, position: int) -> Any:
        raise NotImplementedError

    def arrays(self) -> list[Any]:
        raise NotImplementedError


class TensorFlowGenerator(Generator):
    """``tf.function`` steps over ``tf.Variable`` caches written in place, on ``device``."""

    def __init__(self, keras: Any, net: KerasNet, batch: int, positions: int, cache: str, device: str = "/CPU:0",
                 jit: bool = False):
        import tensorflow as tf

        super().__init__(keras, net, batch, positions, cache)
        self.tf, self.device = tf, device
        with tf.device(device):
            self.caches = [tf.Variable(tf.zeros(shape, self.cache_dtype), trainable=False)
                           for shape in self.forward.cache_shapes(batch) for _ in "kv"]
        self._prefill = tf.function(lambda ids: self.forward(ids, 0, self, True), jit_compile=jit)
        spec = (tf.TensorSpec((batch,), tf.int32), tf.TensorSpec((), tf.int32))
        self._decode = tf.function(lambda ids, position: self.forward(tf.reshape(ids, (-1, 1)), position, self, False),
                                   input_signature=spec, jit_compile=jit)
        warm_up(self)

    def write(self, i: int, k: Any, v: Any, start: Any) -> tuple[Any, Any]:
        at = write_at(start)
        out = []
        for var, new in zip(self.caches[2 * i:2 * i + 2], (k, v)):
            var[:, :, at:at + new.shape[2], :].assign(self.tf.cast(new, var.dtype))
            out.append(var.read_value())  # read after the write (automatic control dependencies)
        return out[0], out[1]

    def prefill(self, ids: np.ndarray) -> Any:
        with self.tf.device(self.device):
            return self._prefill(self.tf.constant(ids, self.tf.int32))

    def decode(self, ids: Any, position: int) -> Any:
        with self.tf.device(self.device):
            return self._decode(ids, np.int32(position))

    def arrays(self) -> list[Any]:
        return list(self.caches)


class _Functional:
    """The cache inside a JAX trace: arrays replaced by ``keras.ops.slice_update``."""

    def __init__(self, ops: Any, arrays: list[Any]):
        self.ops, self.arrays = ops, list(arrays)

    def write(self, i: int, k: Any, v: Any, start: Any) -> tuple[Any, Any]:
        at = write_at(start)
        for j, new in ((2 * i, k), (2 * i + 1, v)):
            self.arrays[j] = self.ops.slice_update(self.arrays[j], (0, 0, at, 0),
                                                   self.ops.cast(new, self.arrays[j].dtype))
        return self.arrays[2 * i], self.arrays[2 * i + 1]


class JaxGenerator(Generator):
    """``jax.jit`` steps taking the variables' values and the cache (donated) as arguments."""

    def __init__(self, keras: Any, net: KerasNet, batch: int, positions: int, cache: str):
        import jax
        import jax.numpy as jnp

        super().__init__(keras, net, batch, positions, cache)
        self.jnp, self.variables = jnp, list(net.model.variables)
        self.caches = [jnp.zeros(shape, self.cache_dtype) for shape in self.forward.cache_shapes(batch) for _ in "kv"]
        self._prefill = jax.jit(lambda values, caches, ids: self._run(values, caches, ids, 0, True),
                                donate_argnums=(1,))
        decode = jax.jit(lambda values, caches, ids, start: self._run(values, caches, ids[:, None], start, False),
                         donate_argnums=(1,))
        self._decode = decode
        warm_up(self)

    def _values(self) -> list[Any]:
        return [v.value for v in self.variables]

    def _run(self, values: list[Any], caches: list[Any], ids: Any, start: Any, prefill: bool
             ) -> tuple[Any, list[Any]]:
        cache = _Functional(self.keras.ops, caches)
        with self.keras.StatelessScope(state_mapping=list(zip(self.variables, values))):
            out = self.forward(ids, start, cache, prefill)
        return out, cache.arrays

    def prefill(self, ids: np.ndarray) -> Any:
        out, self.caches = self._prefill(self._values(), self.caches, self.jnp.asarray(ids, self.jnp.int32))
        return out

    def decode(self, ids: Any, position: int) -> Any:
        out, self.caches = self._decode(self._values(), self.caches, ids, self.jnp.int32(position))
        return out

    def arrays(self) -> list[Any]:
        return list(self.caches)


class TorchGenerator(Generator):
    """Eager ``keras.ops`` under ``torch.no_grad``; the cache written in place by indexing."""

    def __init__(self, keras: Any, net: KerasNet, batch: int, positions: int, cache: str):
        import torch

        super().__init__(keras, net, batch, positions, cache)
        self.torch = torch
        self.caches = [keras.ops.zeros(shape, self.cache_dtype) for shape in self.forward.cache_shapes(batch)
                       for _ in "kv"]

    def write(self, i: int, k: Any, v: Any, start: Any) -> tuple[Any, Any]:
        at = write_at(start)
        for c, new in zip(self.caches[2 * i:2 * i + 2], (k, v)):
            c[:, :, at:at + new.shape[2]] = new.to(c.dtype)
        return self.caches[2 * i], self.caches[2 * i + 1]

    def prefill(self, ids: np.ndarray) -> Any:
        with self.torch.no_grad():
            return self.forward(self.keras.ops.convert_to_tensor(np.asarray(ids, np.int32)), 0, self, True)

    def decode(self, ids: Any, position: int) -> Any:
        with self.torch.no_grad():
            return self.forward(ids[:, None], int(position), self, False)

    def arrays(self) -> list[Any]:
        return list(self.caches)


def generator(keras: Any, net: KerasNet, batch: int, positions: int, cache: str, **tf_options: Any) -> Generator:
    """The generator for the framework Keras runs on in this process (``tf_options``: tensorflow's
    ``device`` and ``jit``)."""
    framework = keras.backend.backend()
    if framework == "tensorflow":
        return TensorFlowGenerator(keras, net, batch, positions, cache, **tf_options)
    if framework == "jax":
        return JaxGenerator(keras, net, batch, positions, cache)
    if framework == "torch":
        return TorchGenerator(keras, net, batch, positions, cache)
    raise ValueError(f"no cached generation for Keras on '{framework}'")


class KerasGeneration:
    """The generation methods of ``Backend`` for an adapter holding a built ``KerasNet`` as ``net``
    (mixed in before ``Backend``); ``_generation_options`` gives the framework's own options."""

    generation_note = ""
    _generator: Optional[Generator] = None

    def _generation_options(self) -> dict[str, Any]:
        return {}

    def start_generation(self, batch: int, positions: int) -> None:
        import keras

        self._generator = generator(keras, self.net, batch, positions, self.workload.generating.cache,
                                    **self._generation_options())

    def prefill(self, ids: np.ndarray) -> Any:
        return self._generator.prefill(ids)

    def decode(self, ids: Any, position: int) -> Any:
        return self._generator.decode(ids, position)

    def cache_bytes(self) -> tuple[int, int]:
        return nbytes(self._generator.arrays()), self._generator.positions
