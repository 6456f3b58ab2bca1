"""PlaidML: the isolated env (``envs.setup``) and real worker runs through the env's Python.

The env is built once per session into ``$BENCHBACKEND_ENVS`` when set, else into pytest's cache
(``.pytest_cache/d/benchbackend-envs``, reused by later sessions). Tests skip with the reason when
pip cannot install the pins here (no network to PyPI, no wheel for this Python).
"""
from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional
from unittest import mock

import numpy as np
import pytest

from benchbackend.backends import envs
from benchbackend.backends import registry as backends
from benchbackend.errors import EnvError
from benchbackend.run import checks
from benchbackend.spec import workload
from benchbackend.spec.workload import Workload
from conftest import FORKS, built_env, make_job

pytestmark = [pytest.mark.plaidml, pytest.mark.slow]
PROBE = envs.Probe("plaidml", backends.BACKENDS["plaidml"].target, backends.BACKENDS["plaidml"].env("cpu"))


# --- the environment -------------------------------------------------------------------------
@pytest.fixture(scope="session")
def plaidml_env(envs_root: Path) -> envs.EnvStatus:
    return built_env(envs_root, "plaidml", PROBE, "PlaidML")


@pytest.fixture
def in_root(envs_root: Path) -> Iterator[Path]:
    with mock.patch.dict(os.environ, {"BENCHBACKEND_ENVS": str(envs_root)}):
        yield envs_root


def test_setup_reuses_a_healthy_env_quickly(plaidml_env: envs.EnvStatus, in_root: Path) -> None:
    logged: list[str] = []
    started = time.perf_counter()
    st = envs.setup("plaidml", PROBE, log=logged.append)
    assert time.perf_counter() - started < 30  # no reinstall: a device probe only
    assert st.ready and any("reusing" in line for line in logged)
    assert st.python == in_root / "plaidml" / "bin" / "python" == envs.python_for("plaidml")
    assert st.versions["plaidml"] == st.versions["plaidml-keras"] == "0.7.0"
    assert st.versions["keras"] == "2.2.4" and "pydantic" in st.versions
    assert "llvm_cpu.0" in st.devices
    assert envs.is_ready("plaidml")
    assert envs.package_version("plaidml", "Keras") == "2.2.4"
    assert envs.package_version("plaidml", "no-such-dist") is None


def test_check_reports_without_changing_anything(plaidml_env: envs.EnvStatus, in_root: Path, tmp_path: Path) -> None:
    st = envs.setup("plaidml", PROBE, check_only=True)
    assert st.ready and st.message.startswith("ready: plaidml 0.7.0")
    missing = tmp_path / "nowhere"
    st = envs.setup("plaidml", PROBE, path=missing, check_only=True)
    assert not st.ready and "benchbackend setup plaidml" in st.message
    assert not missing.exists() and envs.env_dir("plaidml") == in_root / "plaidml"


def test_probe_lists_the_devices(plaidml_env: envs.EnvStatus, in_root: Path) -> None:
    info = envs.probe("plaidml", PROBE)
    assert info["version"] == "0.7.0" and "llvm_cpu.0" in info["devices"]


def test_setup_repairs_an_env_whose_setup_did_not_finish(plaidml_env: envs.EnvStatus, in_root: Path) -> None:
    marker = in_root / "plaidml" / envs.MARKER
    marker.write_text(json.dumps({"created_by": "benchbackend", "name": "plaidml"}))  # setup never finished
    assert not envs.is_ready("plaidml")
    logged: list[str] = []
    st = envs.setup("plaidml", PROBE, log=logged.append)
    assert st.ready and marker.is_file() and any("repairing" in line for line in logged)


def test_marker_from_other_pins_is_not_ready(plaidml_env: envs.EnvStatus, in_root: Path) -> None:
    marker = in_root / "plaidml" / envs.MARKER
    saved = marker.read_text()
    try:
        marker.write_text(json.dumps({**json.loads(saved), "requirements": "0" * 16}))
        assert not envs.is_ready("plaidml")
        assert "other pins" in envs.status("plaidml", PROBE, verify=False).message
    finally:
        marker.write_text(saved)
    assert envs.is_ready("plaidml")


def test_setup_refuses_to_replace_a_folder_that_is_not_a_venv(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with mock.patch.dict(os.environ, {"BENCHBACKEND_ENVS": str(tmp_path / "root")}):
        with pytest.raises(EnvError, match="not created by benchbackend"):
            envs.setup("plaidml", PROBE, path=target)
    assert (target / "notes.txt").read_text() == "keep me"


def test_failed_install_is_one_line_naming_the_step_and_the_log(tmp_path: Path) -> None:
    offline = {"BENCHBACKEND_ENVS": str(tmp_path), "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0",
               "PIP_TIMEOUT": "2", "PIP_CONFIG_FILE": os.devnull}
    with mock.patch.dict(os.environ, offline):
        for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
            os.environ.pop(var, None)
        with pytest.raises(EnvError) as err:
            envs.setup("plaidml", PROBE)
        assert not envs.is_ready("plaidml")
        assert not envs.setup("plaidml", PROBE, check_only=True).ready
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("pip install into the plaidml environment failed")
    assert "plaidml" in msg and str(tmp_path / "plaidml-setup.log") in msg


def test_unknown_env_and_default_location(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from benchbackend.cli import main

    unknown = CliRunner().invoke(main, ["setup", "theano"])
    assert unknown.exit_code == 2 and "'theano' is not one of" in unknown.output
    with mock.patch.dict(os.environ, {"XDG_DATA_HOME": str(tmp_path)}):
        os.environ.pop("BENCHBACKEND_ENVS", None)
        assert envs.env_dir("plaidml") == tmp_path / "benchbackend" / "envs" / "plaidml"
        assert not envs.is_ready("plaidml") and envs.package_version("plaidml", "plaidml") is None
    with mock.patch.dict(os.environ, {"BENCHBACKEND_ENVS": str(tmp_path / "r")}):
        (tmp_path / "r").mkdir()
        (tmp_path / "r" / "plaidml.location").write_text(str(tmp_path / "elsewhere") + "\n")
        assert envs.python_for("plaidml") == tmp_path / "elsewhere" / "bin" / "python"


def test_worker_path_never_exposes_the_main_site_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = Path(envs.__file__).resolve()
    assert envs.worker_pythonpath() == str(here.parent.parent.parent)  # a checkout: its root
    pkg = tmp_path / "lib" / "site-packages" / "benchbackend"
    (pkg / "backends").mkdir(parents=True)
    monkeypatch.setattr(envs, "__file__", str(pkg / "backends" / "envs.py"))
    monkeypatch.setenv("BENCHBACKEND_ENVS", str(tmp_path / "envs"))
    path = Path(envs.worker_pythonpath())
    assert [p.name for p in path.iterdir()] == ["benchbackend"] and (path / "benchbackend").resolve() == pkg
    assert envs.worker_env({"PYTHONPATH": "/x", "PYTHONHOME": "/y", "A": "1"}) == {"PYTHONPATH": str(path), "A": "1"}


# --- real worker runs --------------------------------------------------------------------------
def small(name: str = "mnist", limit: int = 128, epochs: int = 1, repeats: Optional[int] = None,
          **training: Any) -> Workload:
    w = workload.load(name).with_overrides(limit=limit, epochs=epochs)
    upd: dict[str, Any] = {}
    if training:
        upd["training"] = w.training.model_copy(update=training)
    if repeats:
        upd["inference"] = w.inference.model_copy(update={"repeats": repeats})
    return w.model_copy(update=upd) if upd else w


def run_cell(env: envs.EnvStatus, w: Workload, tmp: Path, device: str = "cpu", parity_steps: int = 0,
             extra_env: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
    spec = backends.BACKENDS["plaidml"]
    job = make_job(tmp, w, "plaidml", device=device, repeat=0, parity_steps=parity_steps)
    proc = FORKS.run(env.python, {**envs.worker_env(), **spec.env(device), **(extra_env or {})}, job, 900)
    msgs = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    errors = [m for m in msgs if m.get("type") == "error"]
    assert proc.returncode == 0 and not errors, (errors or proc.stderr[-3000:])
    return msgs


def rows(msgs: list[dict[str, Any]], phase: str) -> list[dict[str, Any]]:
    return [m for m in msgs if m.get("type") == "row" and m.get("phase") == phase]


def info(msgs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(m for m in msgs if m.get("type") == "info")


@pytest.fixture(scope="module")
def normal_run(plaidml_env: envs.EnvStatus, tmp_path_factory: pytest.TempPathFactory):
    w = small(limit=512, epochs=3)
    return w, run_cell(plaidml_env, w, tmp_path_factory.mktemp("normal"), parity_steps=3)


def test_forward_matches_the_numpy_reference(normal_run) -> None:
    w, msgs = normal_run
    forward = next(r for r in rows(msgs, "parity") if not r.get("steps"))
    assert forward["samples"] == w.checks.parity_batch
    assert checks.parity_mismatch(forward["parity_max_abs"], forward["parity_max_rel"], w.checks.parity_rtol,
                                  w.checks.parity_atol) is None, forward


def test_timed_epochs_pass_the_loss_audit(normal_run) -> None:
    """run/loss_audit.py: epoch 1's 3 trajectory steps, then each epoch's first step, all agree."""
    _, msgs = normal_run
    epochs = rows(msgs, "train_epoch")
    assert [(r["loss_audited"], r.get("audit_step")) for r in epochs] == [(3, None), (1, None), (1, None)], epochs


def test_first_training_steps_follow_the_reference(normal_run) -> None:
    w, msgs = normal_run
    trajectory = checks.trajectory(next(r for r in rows(msgs, "parity") if r.get("steps")), w)
    assert trajectory["steps"] == 3 and trajectory["parity_step"] is None, trajectory


def test_normal_tiny_run_is_ok(normal_run) -> None:
    w, msgs = normal_run
    assert info(msgs)["device"] == "cpu" and info(msgs)["mode"] == "keras2"
    assert info(msgs)["backend_version"] == "0.7.0" and info(msgs)["gpu"] == ""
    assert rows(msgs, "build")[0]["params"] == 16938
    # Keras 2.2.4 takes host arrays only: each batch is copied inside the clock, and the build row says why.
    assert info(msgs)["data_on_device"] is False
    assert "data copied per batch inside the clock: Keras 2.2.4" in rows(msgs, "build")[0]["notes"]
    epochs = rows(msgs, "train_epoch")
    assert [r["epoch"] for r in epochs] == [1, 2, 3] and all(r["seconds"] > 0 for r in epochs)
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    assert len(rows(msgs, "inference")) == w.inference.repeats
    forward = [r for r in rows(msgs, "parity") if not r.get("steps")]
    assert checks.cell_status(rows(msgs, "build") + forward + epochs, w) == ("ok", "")
    assert msgs[-1] == {"type": "done"}


def test_a_model_reused_after_the_trajectory_trains_as_a_fresh_one(plaidml_env: envs.EnvStatus,
                                                                    tmp_path: Path) -> None:
    """Without dropout the trajectory check trains the model itself (no twin to compile: PlaidML's
    train function compiles once), and the worker's second ``build`` puts back its weights and its
    optimizer's state (Adam's moments and step count): the epoch trains as a fresh model's does."""
    w = small(limit=128, epochs=1, repeats=1, optimizer="adam", lr=1e-3)
    (tmp_path / "reused").mkdir(), (tmp_path / "fresh").mkdir()
    reused = rows(run_cell(plaidml_env, w, tmp_path / "reused", parity_steps=3), "train_epoch")
    fresh = rows(run_cell(plaidml_env, w, tmp_path / "fresh"), "train_epoch")
    assert reused[0]["loss"] == pytest.approx(fresh[0]["loss"], rel=1e-6, abs=0), (reused, fresh)


def test_overflowing_run_ends_nan_loss_and_leaves_home_alone(plaidml_env: envs.EnvStatus, tmp_path: Path) -> None:
    w = small(limit=128, epochs=2, lr=1.0e6)  # SGD at 1e6: softmax saturates, log(0) in PlaidML's loss
    home = tmp_path / "home"
    home.mkdir()
    (home / ".plaidml").write_text('{"PLAIDML_NOT_A_SETTING": 1}')  # PlaidML raises if it reads this
    before = set(Path(tempfile.gettempdir()).glob("benchbackend-plaidml-*"))
    msgs = run_cell(plaidml_env, w, tmp_path, device="llvm_cpu.0", extra_env={"HOME": str(home)})
    # Its settings live in benchbackend's cache: a worker (ended by os._exit) left a folder per run here.
    assert not set(Path(tempfile.gettempdir()).glob("benchbackend-plaidml-*")) - before
    assert info(msgs)["device"] == "cpu"  # an exact PlaidML device id, named canonically (the CPU)
    epochs = rows(msgs, "train_epoch")
    assert len(epochs) == 1 and not np.isfinite(epochs[0]["loss"])  # training stops at the first NaN
    assert checks.cell_status(epochs, w)[0] == "nan_loss"
    assert (home / ".plaidml").read_text() == '{"PLAIDML_NOT_A_SETTING": 1}' and not (home / ".keras").exists()


def unavailable_message(env: envs.EnvStatus, tmp: Path, device: str) -> Optional[str]:
    msgs = run_cell(env, small(limit=64, repeats=1), tmp, device=device)
    return next((m["message"] for m in msgs if m.get("type") == "unavailable"), None)


def test_gpu_device_picks_an_opencl_gpu_or_says_none(plaidml_env: envs.EnvStatus, tmp_path: Path) -> None:
    opencl = [d for d in plaidml_env.devices if d.startswith("opencl")]
    if opencl:
        pytest.skip(f"this machine has an OpenCL GPU for PlaidML ({opencl[0]}); covered by a real run")
    msg = unavailable_message(plaidml_env, tmp_path, "gpu")
    assert msg and "no OpenCL GPU" in msg and "llvm_cpu.0" in msg, msg


def test_unknown_device_id_lists_the_real_ones(plaidml_env: envs.EnvStatus, tmp_path: Path) -> None:
    msg = unavailable_message(plaidml_env, tmp_path, "opencl_nosuch.7")
    assert msg and "'opencl_nosuch.7'" in msg and "llvm_cpu.0" in msg, msg


# --- PlaidML's OpenCL path on PoCL (a CPU presented as a GPU) --------------------------------------
SHIM = Path(__file__).resolve().parent / "support" / "opencl_cpu_as_gpu.c"
POCL_ENTRY = {
    "description": "PoCL (tests only)",
    "sel": {"platform_regex": ".*Portable Computing Language.*"},
    "settings": {"threads": 32, "vec_size": 1, "mem_width": 64, "max_mem": 32768, "max_regs": 32768,
                 "goal_groups": 1, "goal_flops_per_byte": 20},
}


def pocl_env(env: envs.EnvStatus, tmp: Path) -> dict[str, str]:
    """Env vars that make PlaidML list PoCL's CPU device as an OpenCL GPU, or skip saying why."""
    if not Path("/etc/OpenCL/vendors/pocl.icd").is_file() or not ctypes.util.find_library("OpenCL"):
        # a system package the README's command installs as root: absent without root, so a skip (not a
        # missing framework, which BENCHBACKEND_REQUIRE_ALL turns into a failure)
        pytest.skip("PoCL (Debian's OpenCL for CPUs) is absent here: "
                    "apt-get install pocl-opencl-icd ocl-icd-libopencl1")
    gcc = shutil.which("gcc")
    if not gcc or not SHIM.is_file():
        pytest.skip(f"needs gcc and {SHIM} to build the OpenCL shim")
    lib = tmp / "lib"
    lib.mkdir()
    # Linking the real ICD loader lets every OpenCL call the shim does not wrap resolve through it;
    # PlaidML looks its symbols up in the unversioned libOpenCL.so, which is the shim.
    subprocess.run([gcc, "-shared", "-fPIC", "-O2", "-o", str(lib / "libOpenCL.so"), str(SHIM), "-ldl",
                    "-Wl,--no-as-needed", "-l:libOpenCL.so.1"], check=True, capture_output=True)
    config = json.loads((env.path / "share" / "plaidml" / "experimental.json").read_text())
    config["platform"]["hardware_configs"].append(POCL_ENTRY)  # no built-in entry matches PoCL
    (tmp / "plaidml-pocl.json").write_text(json.dumps(config))
    (tmp / "pocl-cache").mkdir()
    return {"LD_LIBRARY_PATH": f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}".rstrip(":"),
            "PLAIDML_EXPERIMENTAL_CONFIG": str(tmp / "plaidml-pocl.json"),
            "PLAIDML_DEFAULT_CONFIG": str(tmp / "plaidml-pocl.json"),
            "POCL_CACHE_DIR": str(tmp / "pocl-cache")}


def test_opencl_path_runs_a_tiny_cell_on_pocl(plaidml_env: envs.EnvStatus, tmp_path: Path) -> None:
    extra = pocl_env(plaidml_env, tmp_path)
    w = small(limit=64, repeats=1)
    msgs = run_cell(plaidml_env, w, tmp_path, device="gpu", extra_env=extra)
    assert not [m for m in msgs if m.get("type") == "unavailable"], msgs
    assert info(msgs)["device"].startswith("opencl_") and "(OpenCL)" in info(msgs)["gpu"]
    forward = rows(msgs, "parity")[0]
    assert checks.parity_mismatch(forward["parity_max_abs"], forward["parity_max_rel"], w.checks.parity_rtol,
                                  w.checks.parity_atol) is None, forward
    epoch = rows(msgs, "train_epoch")[0]
    assert np.isfinite(epoch["loss"]) and np.isfinite(epoch["val_loss"])
    assert len(rows(msgs, "inference")) == 1


# --- the whole product: CLI, runner, PlaidML beside TensorFlow ---------------------------------
def test_cli_smoke_run_plaidml_beside_tensorflow(plaidml_env: envs.EnvStatus, envs_root: Path, tmp_path: Path) -> None:
    """`benchbackend run mnist -b plaidml -b tensorflow`: both cells ok, PlaidML's device and version in the CSV.

    The issue's smoke is --limit 256 --epochs 1 (8 SGD steps at lr 0.01), which no backend can
    reliably take significantly above chance; 1024 samples (32 steps) can.
    """
    pytest.importorskip("tensorflow", reason="TensorFlow is not installed in the main environment")
    from benchbackend import results
    from conftest import cli

    out_csv = tmp_path / "smoke.csv"
    out = cli("run", "mnist", "-b", "plaidml", "-b", "tensorflow", "--data", "synthetic", "--limit", "1024",
              "--epochs", "1", "--repeats", "1", "-o", str(out_csv), "--no-plots",
              env={"BENCHBACKEND_ENVS": str(envs_root)})
    assert out.returncode == 0, out.stderr[-3000:]
    df = results.read(out_csv)
    assert set(df["status"]) == {"ok"}
    pml = df[df.backend == "plaidml"]
    assert set(pml["device"]) == {"cpu"} and set(pml["backend_version"]) == {"0.7.0"}
    assert (pml[pml.phase == "parity"]["parity_max_rel"] < 1e-4).all()
    assert set(df[df.backend == "tensorflow"]["status"]) == {"ok"}
