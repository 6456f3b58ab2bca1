"""Generation with a key/value cache on torch (issue 38): eager, sdpa and compile generate the float64
reference's greedy tokens through the worker, and each trap the issue names, planted in
``backends/torch/generation.py``, is caught: the new token's rotary position off by one, the cache
written one position late, a prefill without the causal mask, a decode step that attends to cache
positions not yet written (what a shorter prompt's padding would be: every prompt of a batch has one
length, so the harness pads nothing), and a bfloat16 cache where the spec says float32.

The traps run on ``support.decoder.llama_trap`` (rotary base 50: a position's angle is visible)
through the test helper, as the worker calls the adapter; the worker's own path runs on gpt-nano.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support import generation as G
from support.decoder import gpt2_trap, llama_trap

from benchbackend.backends.torch import generation as tg
from benchbackend.run import checks, truth
from benchbackend.spec import workload as W
from conftest import requires_torch, run_cell

pytestmark = requires_torch


def _nano(prompt: int = 16, new: int = 8, batch: int = 2, passes: int = 2) -> W.Workload:
    w = W.load("gpt-nano").with_overrides(limit=32)
    w = w.for_generation(prompt_tokens=[prompt], new_tokens=new, batch_size=batch)
    return w.model_copy(update={"generation": w.generating.model_copy(update={"passes": passes})})


def _greedy(w: W.Workload, mode: str = "eager", prompt: int = 4, new: int = 4, batch: int = 3,
            static: bool = False) -> tuple[bool, int]:
    backend, weights = G.adapter("torch", w, mode)
    ids = G.prompts(w, batch, prompt)
    if static:  # the compiled mode's static-shape decode, run eagerly (no compile time in a test)
        backend.start_generation(batch, prompt + new)
        backend._generator.static = True
        backend._generator._decode = backend._generator._decode_eager
    got = G.generate(backend, ids, new)
    ref, gaps = truth.greedy(w, weights, ids, new)
    return G.agree(got, ref, gaps, 2 * w.checks.parity_rtol)


@pytest.mark.parametrize("mode", ["eager", "sdpa"])
def test_each_mode_generates_the_references_tokens_through_the_worker(tmp_path: Path, mode: str) -> None:
    w = _nano()
    _, rows = run_cell(tmp_path, w, "torch", mode=mode, trains=False, generate=True)
    status, message = checks.cell_status(rows, w)
    assert status == "ok", message
    prefill = [r for r in rows if r["phase"] == "prefill"]
    decode = [r for r in rows if r["phase"] == "decode"]
    (greedy,) = [r for r in rows if r["phase"] == "greedy"]
    assert [r["pass"] for r in prefill] == [1, 2] and len(decode) == 2 * 7  # G - 1 steps per pass
    assert [r["cache_depth"] for r in decode[:7]] == list(range(16, 23))
    assert greedy["tokens_matched"] == 2 * 8 and greedy["mismatch_step"] is None
    # Four layers of 2 kv heads x 32 x (16 + 8) positions x 2 prompts x 2 (k, v) x 4 bytes
    assert prefill[0]["cache_bytes"] == prefill[0]["cache_bytes_expected"] == 4 * 2 * 32 * 24 * 2 * 2 * 4


def test_bf16_agrees_up_to_its_first_tie(tmp_path: Path) -> None:
    """bf16's rule: a tie is a top-two gap of 2 x 1e-2 or less; correct bf16 flips stay below it."""
    w = _nano(prompt=32, new=16, batch=4, passes=1)
    _, rows = run_cell(tmp_path, w, "torch", precision="bf16", trains=False, generate=True)
    status, message = checks.cell_status(rows, w, "bf16")
    (greedy,) = [r for r in rows if r["phase"] == "greedy"]
    assert status == "ok" and "tie below 0.02" in greedy["notes"], (message, greedy["notes"])


@pytest.mark.slow
def test_compile_generates_the_references_tokens_through_the_worker(tmp_path: Path) -> None:
    """The compiled prefill and decode step (the decode step traced once for every position), on the
    small llama trap: gpt-nano's compile took 34 s of CI; the static decode path itself runs on
    gpt-nano's size in the eager tests below."""
    w = llama_trap()
    w = w.for_generation(prompt_tokens=[4], new_tokens=4, batch_size=3)
    w = w.model_copy(update={"generation": w.generating.model_copy(update={"passes": 2})})
    _, rows = run_cell(tmp_path, w, "torch", mode="compile", trains=False, generate=True)
    status, message = checks.cell_status(rows, w)
    (greedy,) = [r for r in rows if r["phase"] == "greedy"]
    assert status == "ok" and greedy["tokens_matched"] == 3 * 4, (message, greedy)


@pytest.mark.parametrize("make", [llama_trap, gpt2_trap])
@pytest.mark.parametrize("static", [False, True])
def test_the_cached_paths_agree_on_both_conventions(make, static: bool) -> None:
    ok, matched = _greedy(make(), static=static)
    assert ok and matched == 3 * 4


def test_a_rotary_position_off_by_one_is_caught(monkeypatch) -> None:
    rows = tg._rows
    monkeypatch.setattr(tg, "_rows", lambda table, start, t: rows(table, start + 1 if t == 1 else start, t))
    assert _greedy(llama_trap(), prompt=3, new=4)[0] is False  # positions 3..6, turned as 4..7


def test_a_cache_written_one_position_late_is_caught(monkeypatch) -> None:
    write = tg.write
    monkeypatch.setattr(tg, "write", lambda cache, where, a: write(cache, where + 1 if len(where) == 1 else where, a))
    assert _greedy(llama_trap(), new=3)[0] is False


def test_a_prefill_without_the_causal_mask_is_caught() -> None:
    w = llama_trap()
    backend, weights = G.adapter("torch", w)
    for mod in backend.net.nodes:
        if isinstance(mod, tg.tt.Attention):
            mod.causal = False
    ids = G.prompts(w, 3, 6)
    ref, gaps = truth.greedy(w, weights, ids, 2)
    assert G.agree(G.generate(backend, ids, 2), ref, gaps, 2e-5)[0] is False


def test_a_decode_that_attends_to_unwritten_positions_is_caught(monkeypatch) -> None:
    """The static decode masks the cache positions past the token's own; unmasked, the query also
    reads the zeros not yet written (a shorter prompt's padding would be read the same way)."""
    later = tg.later
    monkeypatch.setattr(tg, "later", lambda n, where: torch.zeros(len(where), n, dtype=torch.bool)
                        if len(where) == 1 else later(n, where))
    assert _greedy(llama_trap(), new=4, static=True)[0] is False


def test_a_bf16_cache_where_the_spec_says_fp32_is_a_generation_mismatch(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(tg.DTYPES, "fp32", torch.bfloat16)
    w = _nano(prompt=8, new=4, passes=1)
    _, rows = run_cell(tmp_path, w, "torch", trains=False, generate=True)
    status, message = checks.cell_status(rows, w)
    assert status == "generation_mismatch" and "0.5x" in message, message


def test_a_mismatch_names_the_step_and_both_tokens() -> None:
    ref = np.array([[5, 6, 7, 8]])
    gaps = np.full((1, 4), 0.5)
    got = checks.generation(np.array([[5, 6, 9, 8]]), ref, gaps, tie=1e-3)
    assert got["mismatch_step"] == 3 and got["tokens_matched"] == 2 and "9 vs 7" in got["notes"]
    gaps[0, 1] = 1e-4  # a tie at step 2: the comparison stops before the differing token
    got = checks.generation(np.array([[5, 6, 9, 8]]), ref, gaps, tie=1e-3)
    assert got["mismatch_step"] is None and got["tie_step"] == 2 and got["tokens_matched"] == 1
