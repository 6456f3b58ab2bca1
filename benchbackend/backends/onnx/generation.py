"""Greedy generation with a key/value cache as two ONNX graphs, the shape Hugging Face optimum
exports a decoder in (``decoder_model.onnx`` and ``decoder_with_past_model.onnx``), for the
ONNX-consuming runtimes (onnxruntime, OpenVINO). Both are built once per workload, from the same
spec walk and node translations as the forward graph (``graph.py``, ``transformer.py``,
``decoder.py``); only the attention, the position embedding and the output differ:

- **prefill** (``decode=False``): ``input_ids`` int32 ``[batch, prompt]`` -> ``next_ids`` int32
  ``[batch]`` and, per attention layer i (in spec order), ``present.{i}.key`` / ``present.{i}.value``
  float32 ``[batch, kv_heads, prompt, head_dim]``: the keys after their rotation, before the grouped
  heads are repeated (the cache holds ``kv_heads`` heads). Causal mask.
- **decode** (``decode=True``): ``input_ids`` ``[batch, 1]``, ``position`` int64 ``[1]`` (the new
  token's position, one for the whole batch: a batch's prompts have one length) and
  ``past_key_values.{i}.key`` / ``.value`` ``[batch, kv_heads, past, head_dim]`` -> ``next_ids`` and
  ``present`` ``[batch, kv_heads, past + 1, head_dim]`` (the past and the new token's key
  concatenated on the positions' axis: a cache grown by concatenation). No mask: the one query sees
  every key, 0..position.

Batch, prompt and past lengths are dynamic axes. Every other layer is the forward graph's own
translation (``graph._node``: embedding, norms, dense layers, adds, activations), applied to the
tokens in flight. The positions of the tokens in flight are a
``Range(0, prompt)`` in prefill and the ``position`` input in decode; the rotary tables
(``decoder.rope_tables`` over the whole context) and a learned position embedding's table are
Gathered at those rows, and the prefill's causal mask is the context's mask (``decoder.causal_mask``)
Gathered at them on both axes. Grouped heads are repeated in blocks (``decoder.repeat_kv``: query
head h reads key/value head h // (heads // kv_heads), Hugging Face's ``repeat_kv``).

The output: only the last position goes through the output layer (a ``Gather`` of its input at
position -1: the other positions' logits are never read), its activation is left out (a softmax
does not move the argmax) and an ``ArgMax`` over the vocabulary gives the greedy ids (the first of
equal maxima, as NumPy's), Cast to int32: only the ids come back. The cache is float32 (the spec's
``fp32``): a graph whose arrays are float32 throughout.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from ...errors import BackendUnavailable
from ...spec.graph import INPUT as GRAPH_INPUT
from ...spec.graph import Graph, Node, resolve
from ...spec.layers import (
    Attention,
    ClassToken,
    GlobalAvgPool,
    PositionEmbedding,
    Rope,
    SelectToken,
    Tokens,
    gelu_approximate,
)
from ...spec.workload import Workload
from . import decoder
from . import graph as onnx_graph
from . import transformer as onnx_transformer
from .nodes import Builder, Value

INPUT_IDS = "input_ids"
POSITION = "position"
NEXT_IDS = "next_ids"
#: The cache's element type, the only one these graphs hold (``workload.generating.cache``).
CACHE = "fp32"


def past_names(layers: int) -> list[str]:
    """The decode graph's cache inputs, key then value of each attention layer in order."""
    return [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def present_names(layers: int) -> list[str]:
    """Both graphs' cache outputs, in :func:`past_names`' order."""
    return [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def attention_layers(workload: Workload) -> list[Attention]:
    """The workload's attention layers, in spec order (cache layer i is the i-th)."""
    return [n.layer for n in resolve(workload).nodes if isinstance(n.layer, Attention)]


def check(workload: Workload, positions: int, backend: str) -> None:
    """Raise ``BackendUnavailable`` where these graphs cannot generate ``positions`` tokens of
    ``workload``: a cache type other than float32, a network that is not a causal decoder of
    token layers, more positions than the context's tables hold."""
    cache = workload.generating.cache
    if cache != CACHE:
        raise BackendUnavailable(f"{backend}: its generation graphs hold a {CACHE} key/value cache; "
                                 f"the workload asks for {cache}")
    graph = resolve(workload)
    for node in graph.nodes:
        if isinstance(node.layer, (Tokens, ClassToken, SelectToken, GlobalAvgPool)) or (
                isinstance(node.layer, Attention) and not node.layer.causal):
            raise BackendUnavailable(f"{backend}: {node.label()} is not a layer of a causal decoder; "
                                     "only a causal decoder generates")
    context = graph.input_shape[0]
    if positions > context:
        raise BackendUnavailable(f"{backend}: {positions} positions exceed the context of {context} "
                                 "(the rotary and position tables' rows)")


def build_model(workload: Workload, weights: Sequence[np.ndarray], decode: bool) -> onnx.ModelProto:
    """The prefill graph (``decode`` false) or the decode graph of ``workload`` with ``weights``
    (canonical layout), checked."""
    graph = resolve(workload)
    if len(weights) != graph.n_weights:
        raise ValueError(f"the model has {graph.n_weights} weight arrays; got {len(weights)}")
    g = Builder()
    walk = _Walk(g, graph, decode)
    ids = walk.run(weights)
    g.add("Cast", [ids], NEXT_IDS, to=TensorProto.INT32)

    layers = walk.layers
    kv = [(a.groups, a.head_dim) for a in layers for _ in ("key", "value")]
    tokens, total = ("past", "total") if decode else ("prompt", "prompt")
    inputs = [helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT32, ["batch", 1 if decode else "prompt"])]
    if decode:
        inputs.append(helper.make_tensor_value_info(POSITION, TensorProto.INT64, [1]))
        inputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", heads, tokens, dim])
                   for name, (heads, dim) in zip(past_names(len(layers)), kv)]
    outputs = [helper.make_tensor_value_info(NEXT_IDS, TensorProto.INT32, ["batch"])]
    outputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", heads, total, dim])
                for name, (heads, dim) in zip(present_names(len(layers)), kv)]
    proto = helper.make_graph(g.nodes, f"{workload.name}-{'decode' if decode else 'prefill'}", inputs, outputs,
                              initializer=g.inits)
    model = helper.make_model(proto, opset_imports=[helper.make_opsetid("", onnx_graph.OPSET)],
                              producer_name="benchbackend", ir_version=onnx_graph.IR_VERSION)
    onnx.checker.check_model(model, full_check=True)
    return model


class _Walk:
    """One walk of the resolved graph into ``g``: the token layers through ``graph._node`` (the
    forward graph's translation), the attention and the position embedding at the positions in
    flight, the output layer at the last position only. ``layers``: the attention layers met."""

    def __init__(self, g: Builder, graph: Graph, decode: bool):
        self.g, self.graph, self.decode = g, graph, decode
        self.context = graph.input_shape[0]
        self.layers: list[Attention] = []
        self._rows: dict[tuple, tuple[str, str, str]] = {}
        self._mask = ""
        if decode:
            self.positions = POSITION
        else:  # Range(0, prompt): the prompt's positions
            length = g.add("Shape", [INPUT_IDS], "prompt.length", start=1, end=2)
            scalar = g.add("Squeeze", [length, g.ints("prompt.axis", [0])], "prompt.tokens")
            self.positions = g.add("Range", [g.ints("prompt.start", 0), scalar, g.ints("prompt.delta", 1)],
                                   "prompt.positions")

    def run(self, weights: Sequence[np.ndarray]) -> str:
        """The nodes of the whole network; the name of the int64 greedy ids ``[batch]``."""
        g, graph = self.g, self.graph
        values: dict[int, Value] = {GRAPH_INPUT: Value(INPUT_IDS)}
        for node in graph.nodes:
            ins = [values[j] for j in node.inputs]
            w = graph.weights_of(node, weights)
            tag = f"n{node.index}.{node.kind}"
            last = node is graph.output
            if last:  # only the last position's output is read
                ins = [Value(g.add("Gather", [v.name, g.ints(f"{tag}.last{j}", -1)], f"{tag}.last{j}.x", axis=1))
                       for j, v in enumerate(ins)]
            out = Value(self.node(node, ins, w))
            if last:
                if node.activation not in ("none", "softmax"):  # a softmax keeps the argmax where it is
                    out = g.activation(node.activation, out, f"{tag}.{node.activation}", 2,
                                       gelu_approximate(node.layer))
                return g.add("ArgMax", [out.name], "argmax", axis=-1, keepdims=0)
            values[node.index] = g.activation(node.activation, out, f"{tag}.{node.activation}",
                                              len(node.out_shape) + 1, gelu_approximate(node.layer))
        raise AssertionError("the graph has no output node")

    def node(self, node: Node, ins: list[Value], w: list[np.ndarray]) -> str:
        tag = f"n{node.index}.{node.kind}"
        if isinstance(node.layer, Attention):
            return self.attention(tag, ins[0].name, w, node.layer)
        if isinstance(node.layer, PositionEmbedding):  # token t gets row t of the table
            rows = self.g.add("Gather", [self.g.const(f"{tag}.table", w[0]), self.positions], f"{tag}.rows", axis=0)
            return self.g.add("Add", [ins[0].name, rows], tag)
        return onnx_graph._node(self.g, node, ins, w).name

    def rope_rows(self, head_dim: int, rope: Rope) -> tuple[str, str, str]:
        """(cos, signed sin, partner) of the positions in flight: the context's tables (``decoder.rope_tables``)
        Gathered at them, ``(T, head_dim)``; one set per graph and rotary setting."""
        key = (head_dim, rope.base, rope.pairing)
        if key not in self._rows:
            g, tag = self.g, f"rope{len(self._rows)}"
            c, s, partner = decoder.rope_tables(self.context, head_dim, rope)
            cos = g.add("Gather", [g.floats(f"{tag}.cos.table", c), self.positions], f"{tag}.cos", axis=0)
            sin = g.add("Gather", [g.floats(f"{tag}.sin.table", s), self.positions], f"{tag}.sin", axis=0)
            self._rows[key] = (cos, sin, g.ints(f"{tag}.partner", partner.tolist()))
        return self._rows[key]

    def rope(self, tag: str, a: str, head_dim: int, rope: Rope) -> str:
        """``a * C + Gather(a, partner) * S`` (``decoder.rope``) at the positions in flight."""
        cos, sin, partner = self.rope_rows(head_dim, rope)
        g = self.g
        swapped = g.add("Gather", [a, partner], f"{tag}.partner.x", axis=-1)
        return g.add("Add", [g.add("Mul", [a, cos], f"{tag}.cos.x"), g.add("Mul", [swapped, sin], f"{tag}.sin.x")],
                     f"{tag}.rope")

    def causal_mask(self) -> str:
        """The prompt's ``(T, T)`` additive causal mask: the context's (``decoder.causal_mask``) at its rows."""
        if not self._mask:
            g = self.g
            full = g.floats("mask.table", decoder.causal_mask(self.context))
            rows = g.add("Gather", [full, self.positions], "mask.rows", axis=0)
            self._mask = g.add("Gather", [rows, self.positions], "mask", axis=1)
        return self._mask

    def attention(self, tag: str, x: str, w: Sequence[np.ndarray], layer: Attention) -> str:
        """``transformer.attention`` with the cache: the new keys and values (after RoPE, before the
        grouped heads are repeated) are this layer's ``present`` outputs, the decode graph's
        concatenated after its ``past`` inputs."""
        g, i = self.g, len(self.layers)
        self.layers.append(layer)
        heads, groups, head_dim = layer.heads, layer.groups, layer.head_dim
        step = 2 if layer.use_bias else 1
        (wq, bq), (wk, bk), (wv, bv), (wo, bo) = ((w[j], w[j + 1] if layer.use_bias else None)
                                                  for j in range(0, 4 * step, step))
        share = heads // groups

        def project(name: str, kernel: np.ndarray, bias: np.ndarray | None, n: int) -> str:
            flat = onnx_transformer.dense(g, f"{tag}.{name}", x, kernel, bias)
            split = g.ints(f"{tag}.{name}.split", [0, 0, n, head_dim])  # [batch, T, n, head_dim], heads major
            return g.add("Transpose", [g.add("Reshape", [flat, split], f"{tag}.{name}.heads")], f"{tag}.{name}.t",
                         perm=[0, 2, 1, 3])

        q, k, v = project("q", wq, bq, heads), project("k", wk, bk, groups), project("v", wv, bv, groups)
        if layer.rope is not None:
            q = self.rope(f"{tag}.q", q, head_dim, layer.rope)
            k = self.rope(f"{tag}.k", k, head_dim, layer.rope)
        past_k, past_v = past_names(i + 1)[-2:]
        key, value = present_names(i + 1)[-2:]
        if self.decode:
            k = g.add("Concat", [past_k, k], key, axis=2)
            v = g.add("Concat", [past_v, v], value, axis=2)
        else:
            k, v = g.add("Identity", [k], key), g.add("Identity", [v], value)
        if share > 1:
            k = decoder.repeat_kv(g, f"{tag}.k", k, groups, share, -1, head_dim)
            v = decoder.repeat_kv(g, f"{tag}.v", v, groups, share, -1, head_dim)
        kt = g.add("Transpose", [k], f"{tag}.kt", perm=[0, 1, 3, 2])  # [batch, heads, head_dim, keys]
        scores = g.add("Mul", [g.add("MatMul", [q, kt], f"{tag}.qk"), g.scalar(1.0 / math.sqrt(head_dim))],
                       f"{tag}.scaled")
        if not self.decode:
            scores = g.add("Add", [scores, self.causal_mask()], f"{tag}.masked")
        p = g.add("Softmax", [scores], f"{tag}.p", axis=-1)  # over the keys
        mixed = g.add("Transpose", [g.add("MatMul", [p, v], f"{tag}.pv")], f"{tag}.pv.t", perm=[0, 2, 1, 3])
        merged = g.add("Reshape", [mixed, g.ints(f"{tag}.merge", [0, 0, heads * head_dim])], f"{tag}.merged")
        return onnx_transformer.dense(g, f"{tag}.o", merged, wo, bo)


def analytic_cache_bytes(workload: Workload, batch: int, positions: int) -> int:
    """2 x layers x kv_heads x head_dim x positions x batch x 4 (float32): what the cache holds."""
    return sum(2 * a.groups * a.head_dim for a in attention_layers(workload)) * positions * batch * 4
