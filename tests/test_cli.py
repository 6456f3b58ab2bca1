"""CLI surface: help texts, no framework imports outside adapters, one-line usage errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from benchbackend.cli import main
from conftest import ROOT, cli

FRAMEWORKS = ("torch", "tensorflow", "keras", "plaidml", "jax", "chainer", "cupy", "tvm", "onnx", "onnxruntime",
              "openvino", "ray")


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["list", "--help"], ["compare", "--help"],
                                  ["setup", "--help"]])
def test_every_command_has_help(args):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output and len(result.output.splitlines()) > 3


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["list", "--no-probe"], ["list"],
                                  ["compare", str(ROOT / "tests" / "data" / "two-backends.csv")]])
def test_no_ml_framework_is_imported(args):
    code = (
        "import sys, json\n"
        "from benchbackend.cli import main\n"
        f"try:\n    main({args!r}, standalone_mode=False)\nexcept SystemExit:\n    pass\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_list_shows_workloads_and_backends():
    result = CliRunner().invoke(main, ["list", "--no-probe"])
    assert result.exit_code == 0
    assert "cifar10" in result.output and "2,168,362 params" in result.output
    for name in ("numpy", "torch", "tensorflow", "plaidml"):
        assert name in result.output


def test_python_dash_m_works():
    out = cli("--help")
    assert out.returncode == 0 and "run" in out.stdout


@pytest.mark.parametrize("args, needle", [
    (["run", "nope", "-b", "torch"], "unknown workload 'nope'"),
    (["run", "mnist", "-b", "caffe"], "unknown backend 'caffe'"),
    (["run", "does/not/exist.yaml"], "does/not/exist.yaml: workload file not found"),
])
def test_usage_errors_are_one_line_exit_2(args, needle):
    out = cli(*args)
    assert out.returncode == 2
    assert needle in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_yaml_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndata: {dataset: mnist, train: 10, validation: 0, test: 10}\nmodel: [\n")
    out = cli("run", str(bad), "-b", "torch")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.yaml" in lines[0] and "malformed YAML" in lines[0]


def test_plaidml_before_setup_says_to_run_setup(tmp_path):
    out = cli("run", "mnist", "-b", "plaidml", "--data", "synthetic", env={"BENCHBACKEND_ENVS": str(tmp_path)})
    assert out.returncode == 2
    assert "benchbackend setup plaidml" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert "pytest" in ci
    assert ci in (ROOT / "README.md").read_text()


def test_missing_real_data_is_one_line_naming_files_and_the_synthetic_alternative(tmp_path):
    out = cli("run", "mnist", "-b", "numpy", "--data", "auto", "--data-dir", str(tmp_path / "empty"),
              "-o", str(tmp_path / "r.csv"))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and not (tmp_path / "r.csv").exists()
    first = lines[0]
    assert first.startswith("Error:") and "train-images-idx3-ubyte.gz" in first and "--data synthetic" in first
    assert "Traceback" not in out.stderr


def test_interpreter_is_configurable_per_backend(tmp_path, monkeypatch):
    """configs/backends.yaml picks each backend's worker interpreter; a bad entry is one line."""
    from benchbackend import backends, runner
    from benchbackend.errors import BackendUnavailable

    cfg = tmp_path / "backends.yaml"
    cfg.write_text(f"numpy: {sys.executable}\nplaidml: current\n")
    monkeypatch.setenv("BENCHBACKEND_BACKENDS_CONFIG", str(cfg))
    assert runner.python_for(backends.get("numpy")) == sys.executable
    assert backends.get("plaidml").isolated_env is None
    assert backends.get("torch").python is None  # not named: the default
    cfg.write_text("caffe: current\n")
    with pytest.raises(BackendUnavailable, match="unknown backend 'caffe'"):
        backends.get("numpy")
    cfg.write_text("numpy: /no/such/python\n")
    out = cli("run", "mnist", "-b", "numpy", "--data", "synthetic", env={"BENCHBACKEND_BACKENDS_CONFIG": str(cfg)})
    assert out.returncode == 2 and "configured python /no/such/python does not exist" in out.stderr
