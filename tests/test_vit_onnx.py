"""The spec's ONNX graph of a Vision Transformer (``backends/onnx_transformer.py``), which onnxruntime,
OpenVINO and TVM run: a checked opset-17 model, ViT-B/16's parameters exactly, the float64 reference's
output under ONNX's own evaluator (no runtime), and a graph that keeps a framework default (GELU's
tanh form, torch's layernorm epsilon, unscaled attention) misses it by more than the trap's tolerance.

The runtimes' forward parity on the trap is ``tests/test_vit_backends.py``'s.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from support.vit import PARITY_RTOL, trap

from benchbackend.backends.numpy.reference import forward
from benchbackend.run import checks
from benchbackend.run.plan import Options
from benchbackend.spec import model, workload
from conftest import have, missing, spawn_cell

pytestmark = pytest.mark.skipif(not have("onnx"), reason="onnx is not installed (pip install onnx)")

X = np.random.default_rng(0).uniform(0, 1, (8, 4, 4, 2)).astype(np.float32)
WEIGHTS = model.initial_weights(trap())


def _error(w: workload.Workload) -> float:
    """The relative parity error of ``w``'s ONNX graph (on the trap's weights) under ONNX's reference
    evaluator, against the float64 NumPy reference of the trap."""
    from onnx.reference import ReferenceEvaluator

    from benchbackend.backends.onnx import graph as onnx_graph

    out = ReferenceEvaluator(onnx_graph.build_model(w, WEIGHTS)).run(None, {onnx_graph.INPUT: X})[0]
    return checks.parity_errors(np.asarray(out, np.float64), forward(trap(), WEIGHTS, X.astype(np.float64)))[1]


def test_the_trap_graph_is_a_checked_opset_17_model_with_a_dynamic_batch() -> None:
    import onnx

    from benchbackend.backends.onnx import graph as onnx_graph

    m = onnx_graph.build_model(trap(), WEIGHTS)
    onnx.checker.check_model(m, full_check=True)
    assert [o.version for o in m.opset_import if o.domain in ("", "ai.onnx")] == [onnx_graph.OPSET]
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param
    ops = {n.op_type for n in m.graph.node}
    assert {"LayerNormalization", "Erf", "Softmax", "Expand", "Gather"} <= ops
    assert not ops & {"Dropout", "Tanh"}  # dropout is the identity; GELU is the exact form
    assert {a.f for n in m.graph.node if n.op_type == "LayerNormalization"
            for a in n.attribute if a.name == "epsilon"} == {0.5}
    fixed = onnx_graph.build_model(trap(), WEIGHTS, batch_size=3)
    assert fixed.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 3


def test_the_vit_b16_graph_carries_exactly_the_spec_parameters() -> None:
    """Built (and checked) on zero weights, not run: 86,567,656 float weights, no constant counted."""
    from benchbackend.backends.onnx import graph as onnx_graph

    w = workload.load("vit-b16")
    m = onnx_graph.build_model(w, [np.zeros(s, np.float32) for s in model.weight_shapes(w)])
    assert onnx_graph.param_count(m) == model.param_count(w) == 86_567_656
    assert sum(n.op_type == "LayerNormalization" for n in m.graph.node) == 25
    assert sum(n.op_type == "Softmax" for n in m.graph.node) == 13  # 12 attentions and the classifier


def test_the_trap_graph_matches_the_reference_under_onnx_own_evaluator() -> None:
    assert _error(trap()) < PARITY_RTOL / 10  # measured 8.9e-8


@pytest.mark.parametrize("planted", ["tanh gelu", "epsilon 1e-5", "unscaled attention"])
def test_a_graph_with_a_framework_default_misses_the_reference(monkeypatch: pytest.MonkeyPatch,
                                                               planted: str) -> None:
    from benchbackend.backends.onnx import nodes as onnx_nodes

    w = trap()
    if planted == "tanh gelu":
        w = trap(approximate=True)
    elif planted == "epsilon 1e-5":
        w = trap(epsilon=1e-5)
    else:  # the scores' 1/sqrt(head_dim) constant made 1
        scalar = onnx_nodes.Builder.scalar
        monkeypatch.setattr(onnx_nodes.Builder, "scalar",
                            lambda g, v: scalar(g, 1.0 if math.isclose(v, 1 / math.sqrt(5)) else v))
    assert _error(w) > 10 * PARITY_RTOL  # measured: 4.4e-5, 0.42 and 0.2


@pytest.mark.slow
@pytest.mark.skipif(bool(missing("tvm")), reason=missing("tvm"))
def test_tvm_tuned_mode_tunes_the_trap_and_keeps_parity(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MetaSchedule on the Relax module that TVM's ONNX frontend makes of the graph (two trials)."""
    monkeypatch.setenv("BENCHBACKEND_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("BENCHBACKEND_COMPILE_CACHE", str(tmp_path / "cache"))  # a search, not a reuse
    rows, outcome, _ = spawn_cell(tmp_path, trap(), "tvm", mode="tuned", repeat=0, options=Options(tune_trials=2))
    assert outcome.status == "done", outcome
    assert "searched" in next(r for r in rows if r["phase"] == "tune")["notes"]
    assert next(r for r in rows if r["phase"] == "parity")["parity_max_rel"] < PARITY_RTOL


@pytest.mark.slow
@pytest.mark.skipif(bool(missing("openvino")), reason=missing("openvino"))
@pytest.mark.parametrize("mode,precision", [("throughput", "fp32"), ("latency", "bf16")])
def test_openvino_modes_run_the_trap(tmp_path, mode: str, precision: str) -> None:
    """THROUGHPUT at the trap's tolerance; bf16 (where the CPU has it) within bf16's."""
    w = trap()
    rows, outcome, _ = spawn_cell(tmp_path, w, "openvino", mode=mode, precision=precision)
    if precision == "bf16" and outcome.status != "done":
        pytest.skip(f"no bf16 here: {outcome}")
    assert outcome.status == "done", outcome
    (parity,) = [r for r in rows if r["phase"] == "parity"]
    tol = w.checks.tolerance(precision)
    assert checks.parity_mismatch(parity["parity_max_abs"], parity["parity_max_rel"], tol.rtol, tol.atol) is None
