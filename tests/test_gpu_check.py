"""``benchmarks/gpu_check.py`` (issue 23, item 8): on a machine without a GPU every path is one clean
skip line, the report is written and the exit is 0 (1 with ``--require-gpu``); a path known not to
run here is skipped without a run; a run's CSV is judged ok, unavailable or failed. Nothing here
starts a benchmark run: ``nvidia-smi`` is hidden or faked through ``PATH``, so a GPU machine sees
the same."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from benchbackend import results

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
NO_GPU = "skipped: no NVIDIA GPU on this machine (nvidia-smi not found)"


def _module():
    if "gpu_check" not in sys.modules:  # a dataclass looks its module up there
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
        sys.modules["gpu_check"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


def _check(tmp_path: Path, *args: str, nvidia_smi: str = "") -> subprocess.CompletedProcess:
    """Run the script with a PATH of one folder: empty, or holding a fake ``nvidia-smi`` script."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        fake.chmod(0o755)
    env = {**os.environ, "PATH": str(bin_dir)}
    return subprocess.run([sys.executable, str(SCRIPT), "-o", str(tmp_path / "out"), *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_no_gpu_skips_every_path_cleanly_and_writes_the_report(tmp_path):
    paths = list(_module().PATHS)
    r = _check(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    skipped = [line for line in r.stdout.splitlines() if line.endswith(NO_GPU)]
    assert [line.split()[0] for line in skipped] == paths
    report = (tmp_path / "out" / "gpu_check.md").read_text()
    assert report.count(f"| skipped |  |  |  | {NO_GPU.split(': ', 1)[1]} |") == len(paths)
    assert f"0 ok, 0 unavailable, {len(paths)} skipped, 0 failed" in report
    assert not list((tmp_path / "out").glob("*.csv"))  # nothing ran


def test_only_and_require_gpu(tmp_path):
    r = _check(tmp_path, "--only", "torch-eager", "--only", "cupy")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [line for line in r.stdout.splitlines() if "skipped" in line] == [
        f"torch-eager    {NO_GPU}", f"cupy           {NO_GPU}"]
    r = _check(tmp_path, "--only", "jax", "--require-gpu")
    assert r.returncode == 1 and f"jax            {NO_GPU}" in r.stdout
    assert "| jax |" in (tmp_path / "out" / "gpu_check.md").read_text()
    r = _check(tmp_path, "--only", "caffe")
    assert r.returncode == 2 and "invalid choice: 'caffe'" in r.stderr


def test_a_failing_nvidia_smi_says_why(tmp_path):
    said = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    r = _check(tmp_path, "--only", "jax", nvidia_smi=f"echo \"{said}\"; exit 9")
    assert r.returncode == 0 and f"jax            skipped: no usable NVIDIA GPU (nvidia-smi: {said})" in r.stdout


def test_with_a_gpu_a_path_that_cannot_run_here_is_skipped_without_a_run(tmp_path):
    r = _check(tmp_path, "--only", "tvm", nvidia_smi="echo 'Fake GPU, 1024 MiB, 9.0, 1.0'")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("device: Fake GPU, 1024 MiB, 9.0, 1.0")
    assert "tvm            skipped: " in r.stdout  # its adapter takes cpu only (or tvm is not installed)
    assert not (tmp_path / "out" / "tvm.log").exists()
    r = _check(tmp_path, "--only", "torch-nccl-2", nvidia_smi="echo 'Fake GPU, 1024 MiB, 9.0, 1.0'")
    assert r.returncode == 0 and "torch-nccl-2   skipped: needs 2 GPUs; nvidia-smi lists 1" in r.stdout


def _cell_csv(path: Path, device: str, status: str, message: str = "") -> Path:
    writer = results.CsvWriter(path)
    base = {"run_id": "r", "cell_order": 0, "attempt": 1, "workload": "mnist", "backend": "torch",
            "backend_version": "9.9", "device": device, "repeat": 1, "gpu": "Fake GPU" if device != "cpu" else "",
            "math_mode": "ieee"}
    if status != "unavailable":
        writer.write({**base, "phase": "parity", "parity_max_rel": 2e-7, "status": status})
    writer.end_cell({**base, "message": message}, status)
    writer.close()
    return path


def test_a_run_is_judged_from_its_csv(tmp_path):
    gc = _module()
    log = tmp_path / "x.log"
    log.write_text("results: ...\n")

    def judge(csv: Path, rc: int):
        return gc.judge(gc.Outcome("torch-eager", "benchbackend run ...", "no_result"), csv, rc, log)

    ok = judge(_cell_csv(tmp_path / "ok.csv", "cuda:0", "ok"), 0)
    assert (ok.status, ok.parity, ok.math_mode, ok.note, ok.version, ok.clean) == (
        "ok", 2e-7, "ieee", "Fake GPU", "9.9", True)
    on_cpu = judge(_cell_csv(tmp_path / "cpu.csv", "cpu", "ok"), 0)
    assert on_cpu.status == "wrong_device" and not on_cpu.clean
    gone = judge(_cell_csv(tmp_path / "u.csv", "cuda:0", "unavailable", "torch sees no CUDA GPU"), 1)
    assert (gone.status, gone.note, gone.clean) == ("unavailable", "torch sees no CUDA GPU", True)
    bad = judge(_cell_csv(tmp_path / "bad.csv", "cuda:0", "parity_mismatch", "loss differs"), 1)
    assert bad.status == "parity_mismatch" and not bad.clean
    missing = judge(tmp_path / "none.csv", 2)
    assert missing.status == "no_result" and "exited 2" in missing.note and not missing.clean
