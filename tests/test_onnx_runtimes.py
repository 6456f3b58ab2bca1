"""The spec's ONNX graph and the inference-only runtimes that run it (onnxruntime, OpenVINO).

These tests run in a pytest process of their own (``tests/test_isolated.py`` starts it), as the
product runs one framework per worker process: in CI's one big test process, where torch,
TensorFlow, JAX and Keras had already run in-process, ``openvino.Core()`` segfaulted and took the
whole session down. Alone (or in that child process) they pass.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from benchbackend.backends import registry as backends
from benchbackend.data import datasets as data
from benchbackend.errors import BackendUnavailable
from benchbackend.run import checks
from benchbackend.run.plan import Options
from benchbackend.spec import model, workload
from conftest import have, requires, run_cell

requires_onnx = pytest.mark.skipif(not have("onnx"), reason="onnx is not installed (pip install onnx)")
requires_ort = requires("onnxruntime")
requires_ov = requires("openvino")

pytestmark = pytest.mark.skipif(os.environ.get("BENCHBACKEND_ISOLATED") != "onnx_runtimes",  # see conftest
                                reason="runs in its own process: tests/test_isolated.py (OpenVINO segfaulted "
                                       "beside other frameworks in one process)")

ORT = ("onnxruntime", "default")
OV = ("openvino", "latency")
OV_THROUGHPUT = ("openvino", "throughput")
RUNTIMES = [pytest.param(ORT, marks=requires_ort, id="onnxruntime"),
            pytest.param(OV, marks=requires_ov, id="openvino-latency"),
            pytest.param(OV_THROUGHPUT, marks=requires_ov, id="openvino-throughput")]


def _small(name: str = "mnist") -> workload.Workload:
    return workload.load(name).with_overrides(limit=256, epochs=1)


def _run(tmp_path, w: workload.Workload, runtime: tuple[str, str], precision: str = "fp32",
         device: str = "cpu") -> tuple[list[dict], tuple[str, str]]:
    """One inference-only cell in this process: its messages, and the status checks give it."""
    name, mode = runtime
    msgs, rows = run_cell(tmp_path, w, name, mode=mode, precision=precision, device=device,
                          options=Options(threads=2))
    return msgs, checks.cell_status(rows, w, precision)


def _adapter(runtime: tuple[str, str], w: workload.Workload, precision: str = "fp32"):
    backend = backends.get(runtime[0]).load_class()(w, "cpu", runtime[1], precision, {"threads": 2})
    backend.build(model.initial_weights(w, 1))
    return backend


@requires_onnx
def test_graph_is_a_checked_opset_17_model_with_a_dynamic_batch():
    import onnx

    from benchbackend.backends.onnx import graph as onnx_graph

    w = _small("cifar10")
    m = onnx_graph.build_model(w, model.initial_weights(w))
    onnx.checker.check_model(m, full_check=True)
    assert [o.version for o in m.opset_import if o.domain in ("", "ai.onnx")] == [onnx_graph.OPSET]
    dims = m.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and [d.dim_value for d in dims[1:]] == [32, 32, 3]
    assert onnx_graph.param_count(m) == model.param_count(w)
    assert not any(n.op_type == "Dropout" for n in m.graph.node)
    fixed = onnx_graph.build_model(w, model.initial_weights(w), batch_size=4)
    assert fixed.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 4


@requires_onnx
def test_graph_matches_the_reference_under_onnx_own_evaluator():
    from onnx.reference import ReferenceEvaluator

    from benchbackend.backends.numpy import reference
    from benchbackend.backends.onnx import graph as onnx_graph

    w = _small("mnist")
    weights = model.initial_weights(w, 1)
    x = data.normalize(data.load(w, "synthetic").x_val[:4])
    out = ReferenceEvaluator(onnx_graph.build_model(w, weights)).run(None, {onnx_graph.INPUT: x})[0]
    max_abs, max_rel = checks.parity_errors(np.asarray(out, np.float64), reference.forward(w, weights, x))
    assert max_rel < w.checks.parity_rtol


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_forward_parity_at_fp32(tmp_path, runtime, name):
    w = _small(name)
    msgs, (status, msg) = _run(tmp_path, w, runtime)
    parity = [m for m in msgs if m.get("phase") == "parity"]
    assert len(parity) == 1 and parity[0]["parity_max_rel"] < w.checks.parity_rtol, msgs
    assert status == "ok", msg
    assert not [m for m in msgs if m.get("phase") == "train_epoch"]  # inference only
    assert len([m for m in msgs if m.get("phase") == "inference"]) == w.inference.repeats


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_graph_without_the_flatten_permutation_fails_parity(tmp_path, monkeypatch, runtime):
    from benchbackend.backends.onnx import graph as onnx_graph

    monkeypatch.setattr(onnx_graph, "nhwc_to_nchw_rows", lambda h, w, c: np.arange(h * w * c))
    _, (status, msg) = _run(tmp_path, _small("mnist"), runtime)
    assert status == "parity_mismatch", msg


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_batches_land_in_order(runtime):
    """Scores in batches of 7 (a short last batch, several requests in flight) equal one big batch."""
    w = _small("mnist")
    backend = _adapter(runtime, w)
    x = backend.to_device(data.normalize(data.load(w, "synthetic").x_val[:40]))
    one = backend.to_host(backend.scores(x, 1024))
    assert one.shape == (40, w.num_classes)
    np.testing.assert_allclose(backend.to_host(backend.scores(x, 7)), one, rtol=1e-5, atol=1e-7)


@requires_ort
def test_onnxruntime_holds_a_split_as_an_ortvalue_and_binds_its_batches_in_place():
    """The data placement rule: ``to_device`` makes a split one OrtValue on the session's device
    (on CUDA, the one copy before the clock; on a CPU it wraps the NumPy array), and ``scores``
    binds each batch at its offset in that buffer (IOBinding), writing into one output OrtValue
    that ``to_host`` fetches: the same scores as ``session.run`` on NumPy batches."""
    import onnxruntime as ort

    w = _small("mnist")
    backend = _adapter(ORT, w)
    assert backend.place_data(1) is True and backend.data_on_device  # a CPU: the arrays fit
    x_host = data.normalize(data.load(w, "synthetic").x_val[:40])
    x = backend.to_device(x_host)
    assert isinstance(x.value, ort.OrtValue) and (x.device, len(x)) == ("cpu", 40)
    out = backend.scores(x, 7)
    assert isinstance(out, ort.OrtValue) and out.shape() == [40, w.num_classes]
    backend.sync()
    name = backend.session.get_inputs()[0].name
    expected = np.concatenate([backend.session.run(None, {name: x_host[s:s + 7]})[0] for s in range(0, 40, 7)])
    np.testing.assert_allclose(backend.to_host(out), expected, rtol=1e-6, atol=1e-7)


@requires_ov
def test_openvino_runs_fp32_when_asked_and_says_so():
    backend = _adapter(OV, _small("mnist"))
    assert backend.inference_precision() == "f32"
    assert backend.details()["inference_precision"] == "f32"


@requires_ov
def test_openvino_bf16_is_bf16_or_unavailable(tmp_path):
    import openvino as ov

    w = _small("mnist")
    msgs, (status, msg) = _run(tmp_path, w, OV, precision="bf16")
    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        assert msgs[0]["type"] == "unavailable" and "bf16" in msgs[0]["message"]
        return
    build = [m for m in msgs if m.get("phase") == "build"][0]
    assert "inference_precision bf16" in build["notes"]
    assert status == "ok", msg  # within the bf16 tolerance


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_an_unknown_device_is_unavailable(tmp_path, runtime):
    with pytest.raises(BackendUnavailable, match="unknown device 'tpu'"):
        backends.get(runtime[0]).load_class()(_small(), "tpu", runtime[1])
    msgs, _ = _run(tmp_path, _small(), runtime, device="tpu")
    assert msgs[0]["type"] == "unavailable"


@requires_ov
def test_importing_the_openvino_adapter_sends_no_telemetry():
    """OpenVINO's import sends a usage event from a forked process; the adapter must stop that."""
    import subprocess
    import sys

    # A fork from the telemetry thread ends the process with status 3; the event is sent in the
    # background, so the probe waits a moment before it says all was quiet.
    code = ("import os, time\nimport multiprocessing.popen_fork as pf\n"
            "pf.Popen._launch = lambda self, *a: os._exit(3)\n"
            "import benchbackend.backends.openvino.adapter\nimport openvino as ov\nov.Core()\ntime.sleep(3)\n"
            "print('quiet')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "quiet" in out.stdout, (out.returncode, out.stderr[-1500:])


@requires_ort
def test_onnxruntime_cuda_is_asked_for_strict_fp32_on_its_own_gpu():
    """The CUDA provider runs float32 MatMul and Conv in TF32 on Ampere or newer unless told not
    to, and on GPU 0 unless told which: its options carry both (checked without a GPU: the options
    a CUDA cell would pass), and the cell records ``ieee``."""
    backend = _adapter(ORT, _small())
    assert backend.provider_spec() == "CPUExecutionProvider" and backend.math_mode() == "ieee"
    backend.index, backend.provider = 1, "CUDAExecutionProvider"
    assert backend.provider_spec() == ("CUDAExecutionProvider", {"device_id": 1, "use_tf32": 0})
