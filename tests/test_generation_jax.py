"""The jax adapter's greedy generation with a key/value cache (issue 38; ``backends/jax/generation.py``):
both modes (``jit``, a dispatch per token; ``scan``, the decode steps in one ``lax.scan``) produce the
float64 reference's ids (``truth.greedy``, which recomputes the whole sequence at each step) on
gpt-nano and on the two trap decoders, bf16 up to the first tie, with the cache in its spec dtype and
of its analytic size; the decode step compiles once for every position; and each planted mistake of
a cached decoder (a position off by one in the rotary angle, the cache write or the position
embedding, a decode step that cannot see its own key) makes the ids differ.

In this process, through ``support.generation.generate`` (the worker's calls). The figures each test
asserts were measured here and are written beside it.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import pytest
from support import generation as gen
from support.decoder import gpt2_trap, llama_trap

from benchbackend.run import truth
from benchbackend.spec import workload
from benchbackend.spec.model import initial_weights
from benchbackend.spec.workload import GenerationSpec, Workload
from conftest import requires

pytestmark = requires("jax")

TRAPS = {"llama": llama_trap, "gpt2": gpt2_trap}


def _nano() -> Workload:
    return workload.load("gpt-nano")


def lively(w: Workload, scale: float = 2.0) -> list[np.ndarray]:
    """The shared initial weights, each array plus seeded noise of ``scale / sqrt(rows)``: the trap
    decoders' initial weights make gpt2_trap generate one id (3) from every prompt, which no
    planted mistake could change; with these both traps' ids vary with the prompt and the position."""
    rng = np.random.default_rng(5)
    return [(a + scale * rng.standard_normal(a.shape) / np.sqrt(a.shape[0] if a.ndim == 2 else 4)).astype(np.float32)
            for a in initial_weights(w, 1)]


def _run(w: Workload, mode: str, batch: int, prompt: int, new: int, precision: str = "fp32",
         weights: Optional[list[np.ndarray]] = None) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray]:
    """(backend, generated ids, the reference's ids, the reference's top-two gaps), on ``weights``
    (the shared initial weights unless given)."""
    backend, weights_ = gen.adapter("jax", w, mode, precision)
    if weights is not None:
        backend.build(weights)
    weights = weights_ if weights is None else weights
    ids = gen.prompts(w, batch, prompt)
    got = gen.generate(backend, ids, new)
    ref, gaps = truth.greedy(w, weights, ids, new)
    return backend, got, ref, gaps


def _analytic_bytes(w: Workload, batch: int, positions: int, itemsize: int = 4) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x positions x B x itemsize."""
    from benchbackend.spec.graph import resolve
    from benchbackend.spec.layers import Attention

    attns = [n.layer for n in resolve(w).nodes if isinstance(n.layer, Attention)]
    return sum(2 * a.groups * a.head_dim * positions * batch * itemsize for a in attns)


@pytest.mark.parametrize("mode", ["jit", "scan"])
def test_gpt_nano_fp32_is_the_reference(mode: str) -> None:
    """B=2, P=64, G=32: every id equal, no tie in the way (the smallest top-two gap of these 64
    steps is 1.7e-3, far above fp32's tie); the fp32 cache (4 layers x 2 kv heads x 32 x 96
    positions x 2, K and V: 393,216 bytes); one trace of each function for the 31 positions."""
    w = _nano()
    backend, got, ref, gaps = _run(w, mode, 2, 64, 32)
    assert (got == ref).all(), (got, ref)
    ok, matched = gen.agree(got, ref, gaps, 2 * w.checks.tolerance("fp32").rtol)
    assert ok and matched == 2 * 32, (ok, matched)
    assert backend.cache_bytes() == (_analytic_bytes(w, 2, 96), 96) == (393_216, 96)
    traces = backend._generator.traces
    assert traces["prefill"] == 1 and traces["decode"] == 1, traces  # the decode: at start_generation
    assert traces["decode_steps"] == (1 if mode == "scan" else 0), traces


@pytest.mark.parametrize("mode", ["jit", "scan"])
@pytest.mark.parametrize("trap", list(TRAPS))
def test_trap_decoders_are_the_reference(trap: str, mode: str) -> None:
    """llama_trap (RoPE halves base 50, GQA 4/2, RMSNorm, SwiGLU, tied) and gpt2_trap (learned
    positions, LayerNorm, biases, GELU tanh), B=4, P=4, G=4 (the context is 8), on the initial weights
and on ``lively`` ones."""
    w = TRAPS[trap]()
    for weights in (None, lively(w)):
        backend, got, ref, gaps = _run(w, mode, 4, 4, 4, weights=weights)
        assert (got == ref).all(), (got, ref)
        assert gen.agree(got, ref, gaps, 2 * w.checks.tolerance("fp32").rtol) == (True, 16)
        assert backend.cache_bytes() == (_analytic_bytes(w, 4, 8), 8)


def test_gpt_nano_bf16_agrees_up_to_the_first_tie() -> None:
    """bf16 compute, the cache fp32 as the spec says: equal up to the first step whose reference
    top-two gap is at most 2 x bf16's rtol (0.02: measured, steps 7 and 2 of the two prompts, 9 ids
    compared; all 64 ids were equal in fact)."""
    import jax.numpy as jnp

    w = _nano()
    backend, got, ref, gaps = _run(w, "jit", 2, 64, 32, "bf16")
    ok, matched = gen.agree(got, ref, gaps, 2 * w.checks.tolerance("bf16").rtol)
    assert ok and matched >= 1, (ok, matched, got, ref)
    assert backend._generator.params[0].dtype == jnp.bfloat16
    assert all(a.dtype == jnp.float32 for pair in backend._generator.cache for a in pair)
    assert backend.cache_bytes() == (_analytic_bytes(w, 2, 96), 96)


def test_the_cache_is_held_in_the_spec_dtype() -> None:
    """``generation.cache: bf16`` halves the bytes; the ids stay the reference's here (llama_trap)."""
    w = llama_trap().model_copy(update={"generation": GenerationSpec(cache="bf16")})
    backend, got, ref, _ = _run(w, "jit", 2, 4, 4)
    assert backend.cache_bytes() == (_analytic_bytes(w, 2, 8, itemsize=2), 8)
    assert (got == ref).all(), (got, ref)


# --- the traps ---------------------------------------------------------------------------------
def _plants() -> dict[str, tuple[str, Callable[..., Any]]]:
    """Each mistake of a cached decoder as a replacement of one ``generation.py`` function, wrong
    only in the decode steps (one token; the prefill stays right)."""
    import jax.numpy as jnp

    from benchbackend.backends.jax import generation as g

    rope_at, write, position_rows = g.rope_at, g.write, g.position_rows

    def decoding(a: Any, axis: int) -> bool:
        return a.shape[axis] == 1

    return {
        "rope one position ahead": ("rope_at", lambda a, offset, positions, base, pairing: rope_at(
            a, offset + 1 if decoding(a, 1) else offset, positions, base, pairing)),
        "cache written one position back": ("write", lambda c, a, offset: write(
            c, a, offset - 1 if decoding(a, 2) else offset)),
        "decode blind to its own key": ("visible", lambda offset, tokens, keys: (
            jnp.arange(keys)[None, :] < offset + jnp.arange(tokens)[:, None])),
        "position row one back": ("position_rows", lambda table, offset, tokens: position_rows(
            table, offset - 1 if tokens == 1 else offset, tokens)),
    }


#: (workload, plant): each measured to change these ids of the reference's, in both modes, of 16
#: (B=4, G=4, ``lively`` weights) or 32 (gpt-nano, B=1, G=32, initial weights).
PLANTS = [
    ("llama", "rope one position ahead"),  # 9 of 16
    ("llama", "cache written one position back"),  # 7
    ("llama", "decode blind to its own key"),  # 4
    ("gpt2", "cache written one position back"),  # 9
    ("gpt2", "decode blind to its own key"),  # 3
    ("gpt2", "position row one back"),  # 4
    ("nano", "rope one position ahead"),  # 13 of 32
]


@pytest.mark.parametrize("trap,planted", PLANTS)
def test_a_planted_mistake_changes_the_ids(monkeypatch, trap: str, planted: str) -> None:
    from benchbackend.backends.jax import generation as g

    name, wrong = _plants()[planted]
    monkeypatch.setattr(g, name, wrong)
    w, shape = (_nano(), (1, 64, 32)) if trap == "nano" else (TRAPS[trap](), (4, 4, 4))
    weights = None if trap == "nano" else lively(w)
    for mode in ("jit", "scan"):
        _, got, ref, _ = _run(w, mode, *shape, weights=weights)
        print(f"{trap} {planted} {mode}: {(got != ref).sum()} of {got.size} ids differ")
        assert (got != ref).any(), (trap, planted, mode)
