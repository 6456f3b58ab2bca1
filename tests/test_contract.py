"""The backend contract: the worker ends timed regions, the registry is the one source, modes and
precisions are matrix dimensions validated against it."""
from __future__ import annotations

import re

import numpy as np
import pytest
from click.testing import CliRunner

from benchbackend import results
from benchbackend.backends import registry as backends
from benchbackend.cli import main
from benchbackend.spec import workload
from conftest import ROOT, backend_params, cli, invoke, isolated_env, one_line_error, run_cell

LAZY = backends.BackendSpec("lazy", "support.lazy_backend:LazyNumpyBackend", ("numpy",), "numpy", "(test only)",
                            "the NumPy reference on a simulated asynchronous device",
                            modes=(backends.Mode("reference", "the reference, its device busy after every call"),))


@pytest.mark.slow
def test_timed_regions_include_the_device_work_that_only_sync_waits_for(tmp_path, monkeypatch):
    monkeypatch.setenv("LAZY_DELAY", "0.4")
    w = workload.load("mnist").with_overrides(limit=64, epochs=2)
    msgs, _ = run_cell(tmp_path, w, "numpy", target=LAZY.target)
    timed = [m for m in msgs if m.get("phase") in ("train_epoch", "inference")]
    assert len(timed) == 2 + w.inference.repeats
    # 64 samples take milliseconds; the simulated device is busy 0.4 s after each call.
    assert all(m["seconds"] >= 0.4 for m in timed), [m["seconds"] for m in timed]


@pytest.mark.slow
def test_a_backend_registered_only_in_the_tests_runs_through_benchbackend_run(tmp_path, monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "lazy", LAZY)
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))
    monkeypatch.setenv("LAZY_DELAY", "0")
    out = tmp_path / "lazy.csv"
    result = CliRunner().invoke(main, ["run", "mnist", "-b", "lazy", "--data", "synthetic", "--limit", "1024",
                                       "--epochs", "1", "--repeats", "1", "-o", str(out), "--no-plots"])
    assert result.exit_code == 0, result.output
    df = results.read(out)
    assert set(df["backend"]) == {"lazy"} and set(df["status"]) == {"ok"}
    assert set(df["mode"]) == {"reference"} and set(df["precision"]) == {"fp32"}
    assert {"build", "parity", "train_epoch", "inference"} <= set(df["phase"])


@pytest.mark.slow
def test_inference_only_runs_build_parity_and_inference(tmp_path):
    out = tmp_path / "inf.csv"
    r = cli("run", "mnist", "-b", "numpy", "--inference-only", "--data", "synthetic", "--limit", "256",
            "--repeats", "1", "-o", str(out), "--no-plots")
    assert r.returncode == 0, r.stderr[-2000:]
    df = results.read(out)
    assert set(df["phase"]) == {"build", "parity", "inference", "run"} and set(df["status"]) == {"ok"}
    assert set(df["inference_only"].astype(str)) == {"True"}


@pytest.mark.slow
def test_precision_is_a_matrix_dimension(tmp_path):
    out = tmp_path / "p.csv"
    r = cli("run", "mnist", "-b", "numpy", "--precision", "fp32", "--precision", "fp64", "--data", "synthetic",
            "--limit", "256", "--epochs", "1", "--repeats", "1", "-o", str(out), "--no-plots")
    df = results.read(out)
    assert set(df["precision"]) == {"fp32", "fp64"}, r.stderr[-2000:]
    parity = df[(df.phase == "parity")].set_index("precision")["parity_max_rel"]
    assert parity["fp64"] < 1e-9 < parity["fp32"]  # fp64 really computes in float64


@pytest.mark.parametrize("args, needle", [
    (["-b", "numpy", "--mode", "numpy:eager"], "unknown mode 'numpy:eager'; modes are numpy: reference"),
    (["-b", "numpy", "--mode", "jit"], "unknown mode 'jit'"),
    (["-b", "numpy", "--precision", "fp8"], "unknown precision 'fp8'; precisions are numpy: fp32, fp64"),
    (["-b", "numpy", "--mode", "torch:eager"], "backend 'torch' is not among the backends of this run"),
    (["-b", "caffe"], f"unknown backend 'caffe'; choose from {', '.join(backends.BACKENDS)}"),
])
def test_unknown_backend_mode_or_precision_is_one_line_exit_2(args, needle, tmp_path):
    r = invoke("run", "mnist", *args, "--data", "synthetic", "-o", str(tmp_path / "x.csv"))
    assert needle in one_line_error(r)
    assert not (tmp_path / "x.csv").exists()


def test_a_precision_one_backend_lacks_is_an_unavailable_row_for_it(tmp_path):
    from benchbackend.run import plan

    choices = plan.resolve(["numpy", "torch"], [], ["fp64"])
    assert [(c.backend, c.precision, bool(c.problem)) for c in choices] == [("numpy", "fp64", False),
                                                                          ("torch", "fp64", True)]
    assert "torch has no precision fp64; it has fp32, tf32, bf16, fp16" in choices[1].problem


def test_list_shows_modes_and_precisions_of_every_registered_backend():
    out = CliRunner().invoke(main, ["list", "--no-probe"]).output
    for spec in backends.BACKENDS.values():
        assert re.search(rf"{re.escape(spec.name)}\s+precisions: {re.escape(', '.join(spec.precisions))}", out)
        for m in spec.modes:
            assert m.name in out and m.description in out


def test_readme_backend_table_is_the_registry():
    table = CliRunner().invoke(main, ["list", "--markdown"]).output.strip()
    assert table in (ROOT / "README.md").read_text(), "paste `benchbackend list --markdown` into README.md"


@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_nchw_weight_conversion_round_trips(name):
    from benchbackend.spec import model

    w = workload.load(name)
    weights = model.initial_weights(w)
    nchw = model.to_nchw_weights(w, weights)
    assert nchw[0].shape == tuple(np.transpose(weights[0], (3, 2, 0, 1)).shape)
    assert any(not np.array_equal(a, b.T) for a, b in zip(nchw, weights) if a.ndim == 2)  # rows were permuted
    for a, b in zip(model.from_nchw_weights(w, nchw), weights):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("name", backend_params(backends.BACKENDS, build_isolated=True))
def test_every_registered_backend_runs_an_inference_only_cell_with_parity(name, tmp_path, envs_root):
    """Driven by the registry alone: every installed backend, its default mode, fp32, mnist (an
    isolated environment is built for it when it is not yet)."""
    out = tmp_path / f"{name}.csv"
    r = cli("run", "mnist", "-b", name, "--inference-only", "--data", "synthetic", "--limit", "256",
            "--repeats", "1", "-o", str(out), "--no-plots", timeout=1200, env=isolated_env(envs_root, name))
    df = results.read(out)
    assert r.returncode == 0 and set(df["status"]) == {"ok"}, r.stderr[-2000:]
    assert set(df["phase"]) <= {"build", "tune", "parity", "inference", "run"} and (df.phase == "inference").sum() == 5
    assert df[df.phase == "parity"]["parity_max_rel"].iloc[0] < 1e-4
    # The precision rule (backends/precision.py): fp32 is strict IEEE wherever the backend says so.
    declares = {"numpy", "torch", "tensorflow", "jax", "keras-jax", "keras-torch", "onnxruntime"}
    assert set(df["math_mode"]) == ({"ieee"} if name in declares else {""})
    # The data placement rule (Backend.place_data): on a CPU every backend holds its arrays before
    # the clock but PlaidML, whose Keras 2 is fed host arrays batch by batch; and a CPU has no
    # device memory counter, so peak_device_mb is empty where peak_rss_mb is filled.
    assert set(df["data_on_device"]) == ({"False"} if name == "plaidml" else {"True"})
    assert df["peak_rss_mb"].notna().any() and df["peak_device_mb"].isna().all()


def _methods(spec: backends.BackendSpec) -> set[str]:
    """The methods the adapter class and its bases in ``benchbackend.backends`` define, read from
    their source (importing them would import every framework into the test process)."""
    import ast

    module, _, name = spec.target.partition(":")
    found: set[str] = set()
    todo = [(module, name)]
    while todo:
        mod, cls = todo.pop()
        path = ROOT / (mod.replace(".", "/") + ".py")
        tree = ast.parse(path.read_text())
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        found |= {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
        for base in node.bases:
            base_name = base.id if isinstance(base, ast.Name) else ""
            if base_name and base_name != "Backend" and any(
                    isinstance(n, ast.ClassDef) and n.name == base_name for n in tree.body):
                todo.append((mod, base_name))
    return found


@pytest.mark.parametrize("name", [n for n, s in backends.BACKENDS.items() if s.target.startswith("benchbackend.")])
def test_declared_capabilities_are_what_the_adapter_implements(name):
    """The worker acts on the registry's declarations, never on what an adapter happens to have:
    a declaration and its adapter must agree (an undeclared probe would never run; a declared one
    that is missing would crash every cell)."""
    spec = backends.BACKENDS[name]
    methods = _methods(spec)
    assert ("gemm_peak" in methods) == spec.capabilities.peak_probe, methods
    assert ("threads" in methods) == spec.capabilities.thread_control, methods
