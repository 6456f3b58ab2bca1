"""The torch adapter's Vision Transformer: each torch default the issue names, planted in the adapter,
fails the trap network's forward parity (``support.vit.trap``), and both attention paths (the
matmul chain of ``eager`` and ``F.scaled_dot_product_attention`` of ``sdpa``) pass it.

The planted defaults: layernorm's own epsilon (1e-5), GELU's tanh form, scores left unscaled, q/k/v
columns read dim-major, a canonical ``(in, out)`` kernel loaded into ``nn.Linear`` untransposed
(on a trap whose attention is as wide as the model, where the shapes cannot catch it) and the
patch tokens in column-major (w, h) order. Each cell runs in this process (``run_cell``).
"""
from __future__ import annotations

import pytest
from support.vit import PARITY_RTOL, trap

from benchbackend.backends.registry import BACKENDS
from benchbackend.run import checks
from benchbackend.spec import model, workload
from conftest import requires_torch, run_cell

pytestmark = [pytest.mark.torch, requires_torch]


def forward_parity(rows: list[dict]) -> list[float]:
    return [r["parity_max_rel"] for r in rows if r["phase"] == "parity" and not r.get("steps")]


def cell(tmp_path, w=None, mode: str = "eager", precision: str = "fp32", parity_steps: int = 0) -> list[dict]:
    return run_cell(tmp_path, w or trap(), "torch", mode=mode, precision=precision, parity_steps=parity_steps)[1]


@pytest.mark.parametrize("mode", ["eager", "sdpa"])
def test_both_attention_paths_agree_with_the_reference(tmp_path, mode: str) -> None:
    w = trap()
    rows = cell(tmp_path, w, mode, parity_steps=3)
    assert forward_parity(rows) and max(forward_parity(rows)) < PARITY_RTOL  # measured ~1e-7
    traj = next(r for r in rows if r.get("steps"))
    assert traj["parity_step"] is None, traj["notes"]


@pytest.mark.parametrize("kind", ["decoupled", "l2"])
def test_weight_decay_reaches_the_attention_kernels_and_nothing_else(tmp_path, kind: str) -> None:
    from torch import nn

    from benchbackend.backends.torch.graph import GraphNet
    from benchbackend.spec.graph import resolve

    w = trap(weight_decay={"kind": kind, "rate": 0.5})
    net = GraphNet(resolve(w))
    linear = {m.weight.data_ptr() for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    assert {k.data_ptr() for k in net.kernels()} == linear  # q/k/v/o, conv and dense; no bias, norm or token
    assert len(net.kernels()) == sum(model.kernel_mask(resolve(w)))
    traj = next(r for r in cell(tmp_path, w, parity_steps=3) if r.get("steps"))
    assert traj["parity_step"] is None, traj["notes"]


def test_sdpa_is_no_mode_of_a_network_without_attention() -> None:
    why = BACKENDS["torch"].cannot_build(model.vocabulary(workload.load("mnist")), "sdpa")
    assert "attention" in why


# --- torch's defaults, planted: each fails the trap's parity ------------------------------------------
def _plant(monkeypatch: pytest.MonkeyPatch, planted: str) -> None:
    from torch import nn

    from benchbackend.backends.torch import transformer as tt

    if planted == "torch's layernorm epsilon":
        monkeypatch.setattr(tt, "layernorm", lambda width, epsilon: nn.LayerNorm(width))  # eps 1e-5
    elif planted == "tanh gelu":
        monkeypatch.setattr(tt, "gelu", lambda approximate: nn.GELU(approximate="tanh"))
    elif planted == "unscaled attention":
        init = tt.Attention.__init__

        def unscaled(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.scale = 1.0
        monkeypatch.setattr(tt.Attention, "__init__", unscaled)
    elif planted == "dim-major q/k/v columns":  # column j * heads + i read as head i's dimension j
        monkeypatch.setattr(tt.Attention, "split", lambda self, a: a.unflatten(-1, (self.head_dim, self.heads))
                            .permute(0, 3, 1, 2))
    elif planted == "untransposed kernels":  # the canonical (in, out) copied into nn.Linear's (out, in)
        monkeypatch.setattr(tt.Attention, "arrays", lambda self: [t for lin in (self.q, self.k, self.v, self.o)
                                                                  for t in (lin.weight, lin.bias)])
    elif planted == "column-major tokens":  # (w, h) order: position embeddings land on other patches
        monkeypatch.setattr(tt.Tokens, "forward", lambda self, x: x.permute(0, 3, 2, 1).flatten(1, 2))
    else:
        raise ValueError(planted)


PLANTED = ["torch's layernorm epsilon", "tanh gelu", "unscaled attention", "dim-major q/k/v columns",
           "untransposed kernels", "column-major tokens"]


#: sdpa changes the attention's core only: the plants that reach it.
CASES = [(p, "eager") for p in PLANTED] + [(p, "sdpa") for p in ("unscaled attention", "dim-major q/k/v columns")]


@pytest.mark.parametrize(("planted", "mode"), CASES)
def test_the_check_fails_when_torch_keeps_its_default(tmp_path, monkeypatch, planted: str, mode: str) -> None:
    _plant(monkeypatch, planted)
    # attention as wide as the model (2 x 3 = 6), so an untransposed kernel still fits its nn.Linear
    w = trap(head_dim=3) if planted == "untransposed kernels" else trap()
    errors = forward_parity(cell(tmp_path, w, mode))
    assert errors and min(errors) > 10 * PARITY_RTOL, (planted, errors)


def test_an_untransposed_kernel_of_another_shape_is_refused(monkeypatch) -> None:
    """On the default trap (attention 10 wide, the model 6) the same mistake is a loud shape error."""
    from benchbackend.backends.torch.graph import GraphNet
    from benchbackend.spec.graph import resolve

    _plant(monkeypatch, "untransposed kernels")
    w = trap()
    with pytest.raises(ValueError, match="weight array"):
        GraphNet(resolve(w)).load(model.to_nchw_weights(w, model.initial_weights(w)))


@pytest.mark.slow
@pytest.mark.parametrize("mode, precision", [("compile+sdpa", "fp32"), ("sdpa", "bf16"), ("channels_last", "bf16")])
def test_fast_paths_pass_the_trap_at_their_precision(tmp_path, mode: str, precision: str) -> None:
    w = trap()
    msgs = run_cell(tmp_path, w, "torch", mode=mode, precision=precision, parity_steps=3)[0]
    tol = w.checks.tolerance(precision)
    for r in (m for m in msgs if m.get("phase") == "parity" and not m.get("steps")):
        assert checks.parity_mismatch(r["parity_max_abs"], r["parity_max_rel"], tol.rtol, tol.atol) is None, r
    traj = checks.trajectory(next(m for m in msgs if m.get("losses") is not None), w, precision)
    assert traj["parity_step"] is None, traj["notes"]
