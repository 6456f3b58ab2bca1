"""The generation phase (``--generate``): greedy decoding with a key/value cache, timed and checked.

For each prompt length P of ``workload.generation`` (``GenerationSpec``), in the cell's worker:

- the prompts are the first B test sequences' first P tokens (the same for every backend; every
  prompt of a batch has one length, so nothing is padded);
- ``start_generation`` makes the cache for P + G positions (untimed), then ``passes`` generations
  run, each from position 0: the first carries warm-up (compilation, first-touch allocation) and is
  reported apart, as the first epoch is;
- a pass times ``prefill`` (time to first token: the prompt's copy to the device, the prompt pass,
  the first token on the host) and each ``decode`` step (the token read on the host inside the
  step's clock, as a server streams it), or, where the backend runs all steps in one dispatch
  (``decode_steps``: ``jax:scan``), the G - 1 steps as one region;
- the cache's bytes are read after the pass, next to the analytic figure
  ``2 x layers x kv_heads x head_dim x positions x B x bytes per element``;
- greedy parity: the first pass's tokens against the float64 reference's (``truth.greedy``), up to
  the first tie (``checks.generation``); every later pass must generate the first pass's tokens.

Rows: ``prefill`` (one per pass: ``seconds`` is the time to first token), ``decode`` (one per step,
``step`` 1..G-1 and ``cache_depth``, the tokens in the cache as the step begins; one row of
``steps`` G - 1 for a single dispatch), and ``greedy`` (one per prompt length: the parity verdict).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .timing import clock


def cache_elements(workload: Any, batch: int, positions: int) -> int:
    """Key and value elements of every attention layer for ``batch`` sequences of ``positions``."""
    from ..spec.layers import Attention

    return sum(2 * layer.groups * layer.head_dim * positions * batch
               for layer in workload.model if isinstance(layer, Attention))


BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def prompts(arrays: dict[str, np.ndarray], batch: int, length: int) -> np.ndarray:
    """(batch, length) int32 ids: the first test sequences' first tokens (validation's, or
    training's, when the test split is too small)."""
    for split in ("test", "val", "train"):
        x = arrays[f"x_{split}"]
        if len(x) >= batch:
            return np.ascontiguousarray(np.asarray(x[:batch, :length]), np.int32)
    raise RuntimeError(f"--generate needs {batch} prompts (the generation batch); the data has {len(x)} sequences")


def _one_pass(backend: Any, ids: np.ndarray, new_tokens: int) -> tuple[float, list[float], np.ndarray, bool]:
    """(time to first token, each decode region's seconds, the (B, G) tokens, whether one dispatch
    ran every decode step) of one generation."""
    batch, length = ids.shape
    start = clock()
    token = backend.prefill(ids)
    host = np.asarray(backend.to_host(token)).reshape(batch)
    backend.sync()
    ttft = clock() - start
    out, times = [host], []
    start = clock()
    rest = backend.decode_steps(token, length, new_tokens - 1)
    if rest is not None:  # one dispatch for every step
        host_rest = np.asarray(backend.to_host(rest)).reshape(batch, new_tokens - 1)
        backend.sync()
        times.append(clock() - start)
        out += list(host_rest.T)
        return ttft, times, np.stack(out, axis=1).astype(np.int64), True
    for k in range(new_tokens - 1):
        start = clock()
        token = backend.decode(token, length + k)
        host = np.asarray(backend.to_host(token)).reshape(batch)
        backend.sync()
        times.append(clock() - start)
        out.append(host)
    return ttft, times, np.stack(out, axis=1).astype(np.int64), False


def run(cell: Any, weights: list[np.ndarray], base: dict[str, Any], memory: Any) -> None:
    """Every prompt length's generation passes and greedy parity, as rows (``cell``: the worker's
    ``Repeat``; ``memory``: the worker's memory columns of the backend)."""
    from . import checks, truth

    workload, backend = cell.workload, cell.backend
    spec = workload.generating
    batch, new = spec.batch_size, spec.new_tokens
    # A tie: the reference's top two within twice the precision's forward tolerance (relative). At
    # bf16 (tie 0.02) correct torch runs of gpt-nano flipped a token only where the top two were
    # 7e-3 apart or closer (3 weight seeds x 8 prompts x 32 tokens), and never before such a step.
    tie = 2 * workload.checks.tolerance(backend.precision).rtol
    for length in spec.prompt_tokens:
        ids = prompts(cell.arrays, batch, length)
        positions = length + new
        backend.start_generation(batch, positions)
        common = {**base, "prompt_tokens": length, "new_tokens": new, "samples": batch}
        first: Any = None
        for i in range(1, spec.passes + 1):
            (ttft, times, tokens, one), _ = cell.region(lambda: _one_pass(backend, ids, new), host=False)
            held, at = backend.cache_bytes()
            expected = cache_elements(workload, batch, at) * BYTES[spec.cache]
            cell.emit({**common, "phase": "prefill", "pass": i, "seconds": ttft,
                       "tokens_per_s": batch * length / ttft if ttft > 0 else None, "cache_bytes": held,
                       "cache_bytes_expected": expected, **memory(backend), **cell.load})
            for k, seconds in enumerate(times, start=1):
                steps = new - 1 if one else 1
                cell.emit({**common, "phase": "decode", "pass": i, "step": k, "steps": steps,
                           "cache_depth": length + k - 1, "seconds": seconds,
                           "tokens_per_s": batch * steps / seconds if seconds > 0 else None,
                           **({"notes": f"{steps} steps in one dispatch"} if one else {}), **cell.load})
            if first is None:
                first = tokens
            elif not np.array_equal(tokens, first):
                b, k = np.argwhere(tokens != first)[0]
                cell.emit({**common, "phase": "greedy", "mismatch_step": int(k) + 1,
                           "notes": f"pass {i} generated token {tokens[b, k]} at step {k + 1} of prompt {b + 1}, "
                                    f"pass 1 generated {first[b, k]}: passes disagree"})
                return
        steps = min(new, spec.parity_tokens)
        ref, gaps = truth.greedy(workload, weights, ids, steps)
        cell.emit({**common, "phase": "greedy", **checks.generation(first[:, :steps], ref, gaps, tie)})
