"""Greedy generation with the key/value cache on the Keras family (``backends/keras/generation.py``):
tensorflow in this process, keras-jax and keras-torch each in a child process of their own (Keras
picks its framework when it is imported: this file run as a script is the child, ``_child``).

Held to the float64 reference (``truth.greedy``, which recomputes the whole sequence at each step):
gpt-nano at fp32, B=2, P=64, G=32, matches every token (no tie at fp32); the traps (P=4, G=4) too.
Each plant below makes gpt-nano's ids leave the reference's on every backend (a cache written at
position - 1; the new token's rotary row one position late; the prompt pass without its causal
mask), and the cache's measured bytes are the analytic figure, in fp32 under bf16 too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the child runs this file as a script
    sys.path.insert(0, str(HERE))

from support import generation as gen  # noqa: E402
from support.decoder import gpt2_trap, llama_trap  # noqa: E402

from benchbackend.spec import workload as W  # noqa: E402
from benchbackend.spec.graph import resolve  # noqa: E402
from benchbackend.spec.layers import Attention  # noqa: E402
from benchbackend.spec.model import initial_weights  # noqa: E402

TRAPS = {"llama": llama_trap, "gpt2": gpt2_trap}
NANO = dict(batch=2, prompt=64, new=32)


def _nano() -> W.Workload:
    return W.load("gpt-nano")


# --- the plants: each replaces one seam of generation.py or decoder.py ---------------------------------
def _prompt(start: Any) -> bool:
    return isinstance(start, int) and start == 0  # the prompt pass passes a Python 0


def _write_one_early(mp) -> None:
    from benchbackend.backends.keras import generation

    write_at = generation.write_at
    mp.setattr(generation, "write_at", lambda start: write_at(start if _prompt(start) else start - 1))


def _rope_one_late(mp) -> None:
    """The new token's rotary row at position + 1 (the keys in the cache keep theirs: a shift of
    every position alike would not change the scores); the warm-up step at the last position wraps."""
    from benchbackend.backends.keras import generation

    rows = generation.rows
    mp.setattr(generation, "rows", lambda ops, table, start, tokens: rows(
        ops, table, start if _prompt(start) else (start + 1) % table.shape[0], tokens))


def _no_causal_mask(mp) -> None:
    from benchbackend.backends.keras import decoder

    mp.setattr(decoder, "causal_mask", lambda t: np.ones((t, t), bool))


PLANTS = {"cache written at position - 1": _write_one_early, "rotary row of position + 1": _rope_one_late,
          "prompt pass without the causal mask": _no_causal_mask}


def analytic_bytes(w: W.Workload, batch: int, positions: int, itemsize: int = 4) -> int:
    """2 x sum over attention layers of kv_heads x head_dim, x positions x batch x bytes per element."""
    per_token = sum(2 * n.layer.groups * n.layer.head_dim for n in resolve(w).nodes if isinstance(n.layer, Attention))
    return per_token * positions * batch * itemsize


def _reference(w: W.Workload, batch: int, prompt: int, new: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from benchbackend.run import truth

    ids = gen.prompts(w, batch, prompt)
    ref, gaps = truth.greedy(w, initial_weights(w, 1), ids, new)
    return ids, ref, gaps


def _run(backend: str, w: W.Workload, batch: int, prompt: int, new: int, **kw: Any) -> tuple[np.ndarray, Any]:
    be, _ = gen.adapter(backend, w, **kw)
    return gen.generate(be, gen.prompts(w, batch, prompt), new), be


def _agree(w: W.Workload, ids: np.ndarray, ref: np.ndarray, gaps: np.ndarray, precision: str = "fp32"
           ) -> tuple[bool, int]:
    return gen.agree(ids, ref, gaps, 2 * w.checks.tolerance(precision).rtol)


# --- the child: keras-jax or keras-torch ---------------------------------------------------------------
def _child(backend: str) -> dict:
    """Every generation the tests check, on ``backend``, as lists: gpt-nano clean and under each
    plant, each trap."""
    out: dict[str, Any] = {"plants": {}, "traps": {}}
    ids, be = _run(backend, _nano(), **NANO)
    out["nano"], out["bytes"] = ids.tolist(), list(be.cache_bytes())
    for name, plant in PLANTS.items():
        with pytest.MonkeyPatch.context() as mp:
            plant(mp)
            out["plants"][name] = _run(backend, _nano(), **NANO)[0].tolist()
    for trap, make in TRAPS.items():
        out["traps"][trap] = _run(backend, make(), 2, 4, 4)[0].tolist()
    return out


@pytest.fixture(scope="module")
def child(request) -> Any:
    from benchbackend.backends import registry

    made: dict[str, dict] = {}

    def run(backend: str) -> dict:
        if backend not in made:
            env = {**os.environ, **registry.get(backend).env("cpu")}
            proc = subprocess.run([sys.executable, __file__, backend], capture_output=True, text=True, timeout=900,
                                  env=env, cwd=HERE.parent)
            assert proc.returncode == 0, proc.stderr[-4000:]
            made[backend] = json.loads(proc.stdout.strip().splitlines()[-1])
        return made[backend]
    return run


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))
    sys.exit(0)

from conftest import backend_params, requires  # noqa: E402  (pytest's, not the child's)


# --- tensorflow, in this process -----------------------------------------------------------------------
@requires("tensorflow")
@pytest.mark.slow
def test_gpt_nano_generates_the_reference_ids_on_tensorflow():
    w = _nano()
    _, ref, gaps = _reference(w, **NANO)
    ids, be = _run("tensorflow", w, **NANO)
    assert _agree(w, ids, ref, gaps) == (True, NANO["batch"] * NANO["new"])
    assert be.cache_bytes() == (analytic_bytes(w, 2, 96), 96) == (393216, 96)


@requires("tensorflow")
@pytest.mark.parametrize("mode", ["tf.function", "xla"])  # XLA on the small traps: gpt-nano's compile took 16 s
@pytest.mark.parametrize("trap", list(TRAPS))
def test_the_traps_generate_the_reference_ids_on_tensorflow(trap, mode):
    w = TRAPS[trap]()
    _, ref, gaps = _reference(w, 2, 4, 4)
    ids, be = _run("tensorflow", w, 2, 4, 4, mode=mode)
    assert _agree(w, ids, ref, gaps) == (True, 8)
    assert be.cache_bytes() == (analytic_bytes(w, 2, 8), 8)


@requires("tensorflow")
@pytest.mark.slow
@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_cache_bug_changes_the_ids_on_tensorflow(monkeypatch, plant):
    w = _nano()
    _, ref, gaps = _reference(w, **NANO)
    PLANTS[plant](monkeypatch)
    ids, _ = _run("tensorflow", w, **NANO)
    assert not _agree(w, ids, ref, gaps)[0]


@requires("tensorflow")
@pytest.mark.slow
def test_bf16_keeps_an_fp32_cache_and_a_bf16_cache_shows_in_its_bytes(monkeypatch):
    w = _nano()
    _, ref, gaps = _reference(w, **NANO)
    ids, be = _run("tensorflow", w, **NANO, precision="bf16")
    # bf16's tie (a top-two gap within 2e-2) comes early on gpt-nano's initial weights, whose outputs are
    # nearly uniform: measured 9 tokens matched before the first tie (every one of the 64 ids equal, CPU).
    ok, matched = _agree(w, ids, ref, gaps, "bf16")
    assert ok and matched >= 9, matched
    assert be.cache_bytes() == (393216, 96)
    from benchbackend.backends.keras import generation

    monkeypatch.setitem(generation.CACHE_DTYPES, "fp32", "bfloat16")  # the trap: a bf16 cache where fp32 is asked
    _, be = _run("tensorflow", w, 1, 4, 4, precision="bf16")
    assert be.cache_bytes() == (analytic_bytes(w, 1, 8, 2), 8) != (analytic_bytes(w, 1, 8), 8)


# --- keras-jax and keras-torch, each in its own process ------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(["keras-jax", "keras-torch"]))
def test_gpt_nano_and_the_traps_generate_the_reference_ids(child, backend):
    got = child(backend)
    w = _nano()
    _, ref, gaps = _reference(w, **NANO)
    assert _agree(w, np.asarray(got["nano"]), ref, gaps) == (True, 64)
    assert tuple(got["bytes"]) == (analytic_bytes(w, 2, 96), 96)
    for trap, make in TRAPS.items():
        t = make()
        _, ref, gaps = _reference(t, 2, 4, 4)
        assert _agree(t, np.asarray(got["traps"][trap]), ref, gaps) == (True, 8), trap


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(["keras-jax", "keras-torch"]))
@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_cache_bug_changes_the_ids(child, backend, plant):
    w = _nano()
    _, ref, gaps = _reference(w, **NANO)
    assert not _agree(w, np.asarray(child(backend)["plants"][plant]), ref, gaps)[0]


@requires("tensorflow")
def test_tensorflow_traces_the_decode_step_once_at_start_and_the_prompt_pass_once():
    from benchbackend.backends.keras import generation

    traces = {True: 0, False: 0}  # the Python forward runs only while tf.function traces
    forward = generation.CachedForward.__call__

    def counting(self, ids, start, cache, prefill):
        traces[prefill] += 1
        return forward(self, ids, start, cache, prefill)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generation.CachedForward, "__call__", counting)
        be, _ = gen.adapter("tensorflow", llama_trap())
        be.start_generation(2, 8)
        assert traces == {True: 0, False: 1}
        gen.generate(be, gen.prompts(llama_trap(), 2, 4), 4)
    assert traces == {True: 1, False: 2}  # generate's own start_generation traced the decode again, once
