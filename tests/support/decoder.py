"""Tiny decoder language models that every adapter's decoder tests share (tests only; no framework
imported). Issue 37's traps each move these networks' outputs far past the parity tolerance:

- ``llama_trap``: causal grouped-query attention (4 query heads of 4 sharing 2 key/value heads,
  in blocks), rotary positions with a small base (50: every pair turns visibly within 8 tokens)
  paired as halves, no biases, RMSNorm with ``scale: w``, epsilon 1e-5, and a SwiGLU MLP
  ``down(silu(gate(x)) * up(x))``, the output tied to the embedding. Swapping the RoPE pairing or
  its base, shifting or dropping the causal mask, grouping the heads interleaved, reading RMSNorm's
  scale as ``1 + w``, swapping gate and up, or untying the output, each changes the numbers.
- ``gpt2_trap``: learned positions, LayerNorm 1e-5, biases, GELU's tanh form, causal multi-head
  attention, tied output: GPT-2's conventions.

Both train on the ``tokens`` Markov data (vocab 11, context 8) in a few steps.
"""
from __future__ import annotations

from typing import Any

from benchbackend.spec import workload
from benchbackend.spec.workload import Workload

VOCAB, CONTEXT, WIDTH = 11, 8, 16


def _lm(name: str, model: list[dict], seed: int = 3, **training: Any) -> Workload:
    return workload.parse({
        "name": name, "seed": seed,
        "data": {"dataset": "tokens", "vocab": VOCAB, "context": CONTEXT, "train": 64, "validation": 32,
                 "test": 16},
        "model": model,
        "training": {"optimizer": "adam", "lr": 1e-2, "batch_size": 8, "epochs": 1, **training},
        "inference": {"batch_size": 16, "repeats": 1},
        "checks": {"parity_rtol": PARITY_RTOL, "parity_atol": 1e-9}})


def llama_trap(rope_base: float = 50.0, pairing: str = "half", kv_heads: int = 2, scale: str = "w",
               **training: Any) -> Workload:
    """Two Llama-style blocks on 8 tokens of 11 ids, width 16."""
    return _lm("llama-trap", [
        {"type": "embedding", "vocab": VOCAB, "width": WIDTH, "name": "tok"},
        {"type": "repeat", "times": 2, "name": "layer", "layers": [
            {"type": "rmsnorm", "epsilon": 1e-5, "scale": scale},
            {"type": "attention", "heads": 4, "head_dim": 4, "kv_heads": kv_heads, "causal": True,
             "use_bias": False, "rope": {"base": rope_base, "pairing": pairing}, "name": "attn"},
            {"type": "add", "inputs": ["input", "attn"], "name": "mid"},
            {"type": "rmsnorm", "epsilon": 1e-5, "scale": scale, "name": "norm"},
            {"type": "dense", "units": 24, "use_bias": False, "activation": "silu", "name": "gate"},
            {"type": "dense", "units": 24, "use_bias": False, "inputs": ["norm"], "name": "up"},
            {"type": "multiply", "inputs": ["gate", "up"], "name": "glu"},
            {"type": "dense", "units": WIDTH, "use_bias": False, "name": "down"},
            {"type": "add", "inputs": ["mid", "down"], "name": "out"}]},
        {"type": "rmsnorm", "epsilon": 1e-5, "scale": scale},
        {"type": "dense", "units": VOCAB, "use_bias": False, "tied_to": "tok", "activation": "softmax"}],
        **training)


def gpt2_trap(**training: Any) -> Workload:
    """Two GPT-2-style blocks on 8 tokens of 11 ids, width 16."""
    return _lm("gpt2-trap", [
        {"type": "embedding", "vocab": VOCAB, "width": WIDTH, "name": "wte"},
        {"type": "position_embedding"},
        {"type": "repeat", "times": 2, "name": "h", "layers": [
            {"type": "layernorm", "epsilon": 1e-5},
            {"type": "attention", "heads": 2, "head_dim": 8, "causal": True, "name": "attn"},
            {"type": "add", "inputs": ["input", "attn"], "name": "mid"},
            {"type": "layernorm", "epsilon": 1e-5},
            {"type": "dense", "units": 32},
            {"type": "activation", "function": "gelu", "approximate": True},
            {"type": "dense", "units": WIDTH, "name": "proj"},
            {"type": "add", "inputs": ["mid", "proj"], "name": "out"}]},
        {"type": "layernorm", "epsilon": 1e-5},
        {"type": "dense", "units": VOCAB, "use_bias": False, "tied_to": "wte", "activation": "softmax"}],
        **training)


#: float32 adapters should land within ~1e-6 of the float64 reference on these; each trap moves the
#: output by far more (to be measured by each adapter's tests and stated there).
PARITY_RTOL = 1e-5
