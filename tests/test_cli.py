"""CLI surface: help texts, no framework imports outside adapters, one-line usage errors."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from benchbackend.backends import registry as backends
from benchbackend.cli import main
from conftest import ROOT, cli, invoke, one_line_error

#: Every module an adapter may import (from the registry), and Ray (the cluster executor).
FRAMEWORKS = tuple(sorted({m for s in backends.BACKENDS.values() for m in s.requires + s.optional} - {"numpy"}
                          | {"ray"}))


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["list", "--help"], ["compare", "--help"],
                                  ["setup", "--help"]])
def test_every_command_has_help(args):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output and len(result.output.splitlines()) > 3


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["list", "--no-probe"],
                                  pytest.param(["list"], marks=pytest.mark.slow),  # probes every backend
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
    # Which backends train --replicas N, read from the registry (an inference runtime says nothing).
    lines = {line.split()[0]: line for line in result.output.splitlines() if "precisions:" in line}
    assert lines["torch"].endswith("--replicas N: yes, across Ray nodes too")
    assert lines["jax"].endswith("--replicas N: yes, on one machine")
    assert lines["numpy"].endswith("--replicas N: no data-parallel engine")
    assert "--replicas" not in lines["onnxruntime"]


def test_python_dash_m_works():
    out = cli("--help")
    assert out.returncode == 0 and "run" in out.stdout


@pytest.mark.parametrize("args, needle", [
    (["run", "nope", "-b", "torch"], "unknown workload 'nope'"),
    (["run", "mnist", "-b", "caffe"], "unknown backend 'caffe'"),
    (["run", "mnist", "-b", "tvm:tuned"], "unknown backend 'tvm:tuned' (for a mode: -b tvm --mode tvm:tuned)"),
    (["run", "does/not/exist.yaml"], "does/not/exist.yaml: workload file not found"),
    (["run", "mnist", "-b", "numpy", "--retries", "1", "--wait-for-nodes", "60"],
     "--wait-for-nodes, --retries needs --executor ray"),
])
def test_usage_errors_are_one_line_exit_2(args, needle):
    assert needle in one_line_error(invoke(*args))


def test_usage_errors_are_one_line_exit_2_from_the_console_script():
    out = cli("run", "nope", "-b", "torch")
    assert out.returncode == 2 and out.stderr.strip() == "Error: unknown workload 'nope'; available: " \
        + out.stderr.strip().split("available: ")[1]


def test_bad_yaml_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndata: {dataset: mnist, train: 10, validation: 0, test: 10}\nmodel: [\n")
    line = one_line_error(invoke("run", str(bad), "-b", "torch"))
    assert "bad.yaml" in line and "malformed YAML" in line


def test_plaidml_before_setup_says_to_run_setup(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCHBACKEND_ENVS", str(tmp_path))
    assert "benchbackend setup plaidml" in one_line_error(invoke("run", "mnist", "-b", "plaidml", "--data",
                                                                 "synthetic"))


def test_ci_runs_exactly_the_readme_test_command():
    """The README's quick start gives CI's command byte for byte, as a line of its own (`.ci/run`'s
    last line), and before it a new user's quick loop: an install and `pytest -m "not slow"`, a
    marker pyproject.toml declares."""
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert "pytest" in ci and "BENCHBACKEND_REQUIRE_ALL=1" in ci
    quick = (ROOT / "README.md").read_text().split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    lines = quick.splitlines()
    assert ci in lines
    fast = [ln for ln in lines if 'pytest -q -m "not slow"' in ln]
    assert len(fast) == 1 and "pip install -e '.[" in fast[0] and "test]'" in fast[0]
    assert lines.index(fast[0]) < lines.index(ci)
    assert '"slow: ' in (ROOT / "pyproject.toml").read_text()


def test_the_quiet_part_of_ci_names_every_file_that_holds_a_quiet_machine_test():
    """CI's second pytest names its files (collecting all of them imports every framework, 10 s):
    a ``quiet_machine`` test in a file it does not name would never run."""
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    quiet = ci.split("-m quiet_machine", 1)[1].split("&&")[0].split()
    marked = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                    if re.search(r"^(@pytest\.mark\.quiet_machine|pytestmark.*quiet_machine)", p.read_text(), re.M))
    assert marked and sorted(quiet) == marked, (quiet, marked)


def test_missing_real_data_is_one_line_naming_files_and_the_synthetic_alternative(tmp_path):
    line = one_line_error(invoke("run", "mnist", "-b", "numpy", "--data", "auto", "--data-dir",
                                 str(tmp_path / "empty"), "-o", str(tmp_path / "r.csv"), "-q"))
    assert not (tmp_path / "r.csv").exists()
    assert "train-images-idx3-ubyte.gz" in line and "--data synthetic" in line


def test_interpreter_is_configurable_per_backend(tmp_path, monkeypatch):
    """configs/backends.yaml picks each backend's worker interpreter; a bad entry is one line."""
    from benchbackend.errors import BackendUnavailable
    from benchbackend.run import launch

    cfg = tmp_path / "backends.yaml"
    cfg.write_text(f"numpy: {sys.executable}\nplaidml: current\n")
    monkeypatch.setenv("BENCHBACKEND_BACKENDS_CONFIG", str(cfg))
    assert launch.python_for(backends.get("numpy")) == sys.executable
    assert backends.get("plaidml").isolated_env is None
    assert backends.get("torch").python is None  # not named: the default
    cfg.write_text("caffe: current\n")
    with pytest.raises(BackendUnavailable, match="unknown backend 'caffe'"):
        backends.get("numpy")
    cfg.write_text("numpy: /no/such/python\n")
    line = one_line_error(invoke("run", "mnist", "-b", "numpy", "--data", "synthetic"))
    assert "configured python /no/such/python does not exist" in line


def test_the_all_extra_installs_every_backend_extra_and_ray():
    """CI installs `.[all,test]`: a backend whose extra is missing from `all` would go untested (and
    `--scenario`'s LoadGen, `loadgen`; benchmarks/loops.py's optax, `bench`)."""
    import re

    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (req,) = extras["all"]
    named = set(re.fullmatch(r"benchbackend\[(.*)\]", req).group(1).split(","))
    wanted = {s.extra for s in backends.BACKENDS.values() if s.extra} | {"ray", "text", "loadgen", "bench"}
    assert named == wanted and wanted <= set(extras)


def test_small_things_of_a_new_users_first_hour(tmp_path, monkeypatch):
    """``list`` says "1 epoch", names why it is slow the first time (it probes each backend's
    devices), and ``run --help`` names every precision a backend has (tf32 was left out)."""
    import yaml

    from benchbackend import inventory
    from benchbackend.backends import registry

    spec = yaml.safe_load((ROOT / "workloads" / "mnist.yaml").read_text())
    spec["name"], spec["training"]["epochs"] = "one", 1
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("BENCHBACKEND_WORKLOADS", str(tmp_path))
    monkeypatch.setenv("BENCHBACKEND_CACHE", str(tmp_path / "cache"))
    listed = invoke("list", "--no-probe").output
    line = next(ln for ln in listed.splitlines() if ln.strip().startswith("one "))
    assert line.endswith(", 1 epoch"), line
    heard: list[str] = []
    inventory.probes([registry.get("numpy")], progress=heard.append)
    assert heard and heard[0].startswith("probing devices of numpy")
    helped = " ".join(invoke("run", "--help").output.split())
    every = dict.fromkeys(p for s in registry.BACKENDS.values() for p in s.precisions)
    assert all(p in helped.split("--precision [BACKEND:]PRECISION")[1].split("--replicas")[0] for p in every), every
