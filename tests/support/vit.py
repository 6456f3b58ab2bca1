"""Tiny transformer workloads that every adapter's ViT tests share (tests only; no framework imported).

``trap`` is built so that each framework default the issue names moves the forward output far past
the fp32 parity tolerance (the figures: ``tests/test_vit_traps.py``):

- layernorm ``epsilon`` 0.5: torch's 1e-5, Keras' 1e-3 or flax's 1e-6 in its place normalizes by a
  different scale;
- GELU: the tanh form is at most 5e-4 from the exact one, which moves this network's output by
  4.4e-5: the trap's parity tolerance is ``PARITY_RTOL`` (3e-6), not the default 1e-4;
- attention with ``heads * head_dim`` (2 x 5 = 10) unlike the width (6): an adapter that assumes
  they are equal (torch's ``nn.MultiheadAttention``) cannot build it; one that leaves the scores
  unscaled, or reads the q/k/v kernels dim-major instead of heads-major, gets other scores.

``vit_tiny_smoke`` is the shipped ``vit-tiny`` at a size CI can run on every backend.
"""
from __future__ import annotations

from typing import Any

from benchbackend.spec import workload
from benchbackend.spec.workload import Workload


def trap(epsilon: float = 0.5, approximate: bool = False, heads: int = 2, head_dim: int = 5,
         optimizer: str = "adam", **training: Any) -> Workload:
    """A two-block pre-norm ViT on 4x4x2 images (4 patch tokens of width 6 and a class token)."""
    gelu = {"type": "activation", "function": "gelu", "approximate": approximate}
    block = [
        {"type": "layernorm", "epsilon": epsilon},
        {"type": "attention", "heads": heads, "head_dim": head_dim, "name": "{b}_attn"},
        {"type": "add", "inputs": ["{prev}", "{b}_attn"], "name": "{b}_mid"},
        {"type": "layernorm", "epsilon": epsilon},
        {"type": "dense", "units": 16}, gelu,
        {"type": "dense", "units": 6, "name": "{b}_mlp"},
        {"type": "add", "inputs": ["{b}_mid", "{b}_mlp"], "name": "{b}"},
    ]
    layers: list[dict] = [
        {"type": "conv2d", "filters": 6, "kernel_size": 2, "stride": 2, "padding": "valid"},
        {"type": "tokens"}, {"type": "class_token"}, {"type": "position_embedding"},
        {"type": "dropout", "rate": 0.1, "name": "embed"}]
    prev = "embed"
    for b in ("b1", "b2"):
        for spec in block:
            layers.append({k: ([i.format(b=b, prev=prev) for i in v] if k == "inputs" else
                               v.format(b=b) if k == "name" else v) for k, v in spec.items()})
        prev = b
    layers += [{"type": "layernorm", "epsilon": epsilon}, {"type": "select_token"},
               {"type": "dense", "units": 4, "activation": "softmax"}]
    return workload.parse({
        "name": "vit-trap", "seed": 5,
        "data": {"dataset": "synthetic", "input_shape": [4, 4, 2], "num_classes": 4,
                 "train": 64, "validation": 32, "test": 16},
        "model": layers,
        "training": {"optimizer": optimizer, "lr": 1e-3, "batch_size": 8, "epochs": 1, **training},
        "inference": {"batch_size": 16, "repeats": 1},
        # float32 adapters land within 1e-7 of the float64 reference here; the tanh GELU 4.4e-5 away
        "checks": {"parity_rtol": PARITY_RTOL, "parity_atol": 1e-9}})


#: The trap's forward-parity tolerance: the NumPy reference in float32 is 9e-8 from float64 on it, and
#: the subtlest trap (the tanh GELU) moves the output by 4.4e-5 (layernorm epsilons: 0.2 to 0.4).
PARITY_RTOL = 3e-6


def vit_tiny_smoke(train: int = 64) -> Workload:
    """The shipped vit-tiny on ``train`` synthetic samples, one epoch, one inference repeat."""
    w = workload.load("vit-tiny")
    return w.model_copy(update={
        "data": w.data.model_copy(update={"train": train, "validation": train // 2,
                                          "test": train // 2}),
        "training": w.training.model_copy(update={"epochs": 1}),
        "inference": w.inference.model_copy(update={"batch_size": 32, "repeats": 1})})
