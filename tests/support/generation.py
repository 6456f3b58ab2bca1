"""Greedy generation through an adapter's cache methods, in this process (tests only; no framework
imported here): what every adapter's generation test compares with the float64 reference
(``truth.greedy``). The worker's own loop (``run/generation.py``) times the same calls.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from benchbackend.backends import registry
from benchbackend.backends.spec import load_class
from benchbackend.spec.model import initial_weights
from benchbackend.spec.workload import Workload


def prompts(workload: Workload, batch: int, length: int, seed: int = 0) -> np.ndarray:
    """(batch, length) int32 token ids below the workload's vocabulary, seeded."""
    return np.random.default_rng([seed, 11]).integers(0, workload.num_classes, (batch, length)).astype(np.int32)


def adapter(name: str, workload: Workload, mode: str | None = None, precision: str = "fp32",
            device: str = "cpu", repeat: int = 1) -> tuple[Any, list[np.ndarray]]:
    """The backend ``name`` built on ``workload``'s shared initial weights (repeat ``repeat``)."""
    spec = registry.get(name)
    backend = load_class(spec.target)(workload, device, mode or spec.default_mode, precision, None)
    weights = initial_weights(workload, repeat)
    backend.build(weights)
    return backend, weights


def generate(backend: Any, ids: np.ndarray, new_tokens: int) -> np.ndarray:
    """(B, new_tokens) greedy ids: ``prefill`` gives the first, then ``decode`` (or one
    ``decode_steps`` dispatch) the rest, as the worker calls them."""
    batch, length = ids.shape
    backend.start_generation(batch, length + new_tokens)
    first = backend.prefill(np.ascontiguousarray(ids, np.int32))
    out = [np.asarray(backend.to_host(first)).reshape(batch)]
    rest = backend.decode_steps(first, length, new_tokens - 1)
    if rest is not None:
        out += list(np.asarray(backend.to_host(rest)).reshape(batch, new_tokens - 1).T)
    else:
        token = first
        for k in range(new_tokens - 1):
            token = backend.decode(token, length + k)
            out.append(np.asarray(backend.to_host(token)).reshape(batch))
    return np.stack(out, axis=1).astype(np.int64)


def agree(ids: np.ndarray, ref: np.ndarray, gaps: np.ndarray, tie: float) -> tuple[bool, int]:
    """(no mismatch before a tie, tokens matched), by the worker's own rule (``checks.generation``):
    per prompt, the steps are compared until the reference's top-two gap is at most ``tie``."""
    from benchbackend.run import checks

    verdict = checks.generation(ids, ref, gaps, tie)
    return verdict["mismatch_step"] is None, verdict["tokens_matched"]
