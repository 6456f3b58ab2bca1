"""The jax adapter's transformer layers (``backends/jax_transformer.py``): each JAX default the issue
names, planted in the adapter, is a forward-parity failure on ``support.vit.trap``, and the scan mode
in bf16 trains the trap within bf16's tolerances.

The adapter as it is passes the trap at ``PARITY_RTOL`` (``test_vit_backends.py::test_the_trap_network
_agrees_with_the_reference[jax]``); these controls show that check would catch it keeping ``jax.nn.gelu``'s
tanh default, flax's layernorm epsilon, unscaled scores or a dim-major head split. Each runs one cell
in this process without training (build, forward parity, inference): a few seconds.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
from support.vit import PARITY_RTOL, trap

from benchbackend.run import checks
from conftest import requires, run_cell

pytestmark = [requires("jax"), pytest.mark.slow]


def _planted() -> dict[str, tuple[str, Callable[..., Any]]]:
    """Each JAX default as a replacement of one ``jax_transformer`` function: (its name, the default)."""
    import jax

    from benchbackend.backends.jax import transformer as jt

    layernorm = jt.layernorm

    def dim_major(a: Any, heads: int) -> Any:  # columns read (head_dim, heads) instead of (heads, head_dim)
        return a.reshape(*a.shape[:-1], a.shape[-1] // heads, heads).swapaxes(-1, -2)

    return {
        "jax.nn.gelu's tanh default": ("gelu", lambda x, approximate: jax.nn.gelu(x)),
        "flax's layernorm epsilon 1e-6": ("layernorm", lambda x, g, b, epsilon: layernorm(x, g, b, 1e-6)),
        "unscaled attention scores": ("score_scale", lambda head_dim: 1.0),
        "dim-major head split": ("split_heads", dim_major),
    }


def _forward_parity(rows: list[dict]) -> list[dict]:
    parity = [r for r in rows if r["phase"] == "parity" and not r.get("steps")]
    assert parity, rows
    return parity


@pytest.mark.parametrize("planted", ["jax.nn.gelu's tanh default", "flax's layernorm epsilon 1e-6",
                                     "unscaled attention scores", "dim-major head split"])
def test_the_parity_check_fails_when_jax_keeps_its_default(tmp_path, monkeypatch, planted: str) -> None:
    from benchbackend.backends.jax import transformer as jt

    name, default = _planted()[planted]
    monkeypatch.setattr(jt, name, default)
    rows = run_cell(tmp_path, trap(), "jax", trains=False)[1]
    # Measured here: the tanh GELU 3.4e-5 (11x the tolerance; the adapter as it is: 9e-8), the rest far more.
    assert min(r["parity_max_rel"] for r in _forward_parity(rows)) > 3 * PARITY_RTOL, planted


def test_scan_in_bf16_trains_the_trap_within_bf16_tolerances(tmp_path) -> None:
    """Both of the adapter's other paths in one cell (compiling is what costs here): the scan block
    trains the epoch, and bf16 (float32 layernorm statistics and softmax) meets bf16's tolerances."""
    import math

    from benchbackend.run.plan import Options

    w = trap()
    # 64 samples at batch 8 and K = 3: two scan blocks, then two single steps.
    msgs, rows = run_cell(tmp_path, w, "jax", mode="scan", precision="bf16", parity_steps=3,
                          options=Options(steps_per_execution=3))
    tol = w.checks.tolerance("bf16")
    for r in _forward_parity(rows):
        assert checks.parity_mismatch(r["parity_max_abs"], r["parity_max_rel"], tol.rtol, tol.atol) is None, r
        assert r["parity_max_rel"] > 100 * PARITY_RTOL, r  # bfloat16 really ran: far off the float64 reference
    traj = checks.trajectory(next(m for m in msgs if m.get("losses") is not None), w, "bf16")
    assert traj["parity_step"] is None, traj["notes"]
    epochs = [r for r in rows if r["phase"] == "train_epoch"]
    assert len(epochs) == 1 and math.isfinite(epochs[0]["loss"]), epochs
