"""The precision rule every backend follows, and the ``math_mode`` column that records it.

Frameworks disagree on what "float32" means on a GPU: on NVIDIA Ampere or newer, TensorFlow and
JAX run float32 matmuls and convolutions in TF32 (a 10-bit mantissa) by default, torch runs its
cuDNN convolutions in TF32 but not its matmuls. So here:

- ``fp32`` is strict IEEE float32 on every backend and device: TF32 off in torch (matmul, cuDNN
  convolution and RNN), TensorFlow (``enable_tensor_float_32_execution(False)``) and JAX
  (``jax_default_matmul_precision="highest"``), Keras 3 through the framework under it;
- ``tf32`` is its own precision: TF32 on, where the device has it (an NVIDIA GPU of compute
  capability 8.0 or newer); anywhere else the cell is ``unavailable`` and says why;
- reduced precisions (``bf16``, ``fp16``) keep their float32 parts strict.

``math_mode`` is what the cell set for its float32 matmuls and convolutions: ``ieee`` or ``tf32``
(empty for a backend that does not declare it). The cuDNN/XLA autotuning policy is one rule too:
on, in every framework (each picks its fastest kernels; the search lands in the first epoch,
which is timed apart), recorded in the build row's notes on a GPU.
"""
from __future__ import annotations

from typing import Optional

from ..errors import BackendUnavailable

#: The oldest NVIDIA compute capability with TF32 tensor cores (Ampere).
TF32_CAPABILITY = (8, 0)


def math_mode(precision: str) -> str:
    """The float32 math mode a cell of ``precision`` sets: ``tf32`` only when asked for."""
    return "tf32" if precision == "tf32" else "ieee"


def check_tf32(backend: str, gpu: Optional[str], capability: Optional[tuple[int, int]], device: str = "cpu") -> None:
    """Raise ``BackendUnavailable`` unless the cell runs on a GPU with TF32 (``gpu``: its name, None
    elsewhere; ``capability``: its compute capability, None when the framework does not say;
    ``device``: the cell's device, for the message)."""
    if gpu is None:
        raise BackendUnavailable(f"{backend}: tf32 is a math mode of NVIDIA GPUs (compute capability 8.0 or newer); "
                                 f"this cell runs on {device}: use --precision fp32")
    if capability is not None and tuple(capability) < TF32_CAPABILITY:
        raise BackendUnavailable(f"{backend}: tf32 needs compute capability 8.0 or newer; {gpu} has "
                                 f"{capability[0]}.{capability[1]}")


def capability_of(text: object) -> Optional[tuple[int, int]]:
    """``(8, 0)`` from ``"8.0"`` or ``(8, 0)`` (how JAX and TensorFlow say it); None if unknown."""
    if isinstance(text, (tuple, list)) and len(text) == 2:
        return int(text[0]), int(text[1])
    major, _, minor = str(text or "").partition(".")
    return (int(major), int(minor or 0)) if major.isdigit() and (minor or "0").isdigit() else None
