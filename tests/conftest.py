"""Shared fixtures. Framework tests skip with a reason when the framework is absent."""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
#: The suite's caches (GEMM peaks probed while its tests load the machine, device lists, tuning
#: databases, reference results) live beside its isolated environments, never in the user's
#: ~/.cache/benchbackend: a peak probed under the suite's load reads low, and the user's next run
#: would show its first repeat's MFU against it. Tests that need an empty cache still set their own.
os.environ["BENCHBACKEND_CACHE"] = str(ROOT / ".pytest_cache" / "d" / "benchbackend-cache")
#: Compiled programs (torch.compile's inductor cache, JAX's compilation cache: ``--compile-cache
#: warm``) outlive the clone, as torch's own default folder (/tmp/torchinductor_root) did before
#: benchbackend named one: a program compiled in one run of the suite is read back in the next,
#: the same executable, so no check sees a difference; only compiling is skipped. Tests of tuning
#: or of the cache itself set their own empty folder.
os.environ.setdefault("BENCHBACKEND_COMPILE_CACHE", str(Path(tempfile.gettempdir()) / "benchbackend-tests-compile"))

#: Under pytest-xdist, each test process gets one core of its own: the frameworks its cells start
#: (and the ones it imports) run one thread unless a test asks for more (``--threads``, which sets
#: these for its worker). With every framework's default, two test processes on two cores ran four
#: or more spinning pools against each other, and the suite took 30% longer (measured on
#: test_keras3, test_run, test_fast_modes and test_graph_backends: 193 s against 135 s). The
#: product's own default (all cores for the one cell that runs) is tested where it is measured,
#: by the quiet-machine tests, which run without xdist.
#: XLA's LLVM backend at optimization level 0 too: a test's tiny networks spend most of their JAX
#: time compiling (test_decoder_jax's parity and bf16 tests: 26.8 s at the default level, 17.1 s at
#: 0, every check passing). The level is LLVM's code generation, not XLA's fusion or its numerics
#: (no fast math either way); the product's runs keep XLA's default.
ONE_CORE = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
            "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0"}
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var, _value in ONE_CORE.items():
        os.environ.setdefault(_var, _value)

#: glibc's heap kept for every process of the suite, as the NumPy engines' workers have it
#: (``registry._numpy_env``): the NumPy reference runs in every test process and in every
#: framework's worker (parity, trajectories), and glibc otherwise maps and unmaps its arrays on
#: each step (measured on six NumPy-heavy files, -n 2: 108 s against 99 s). Arithmetic is unchanged.
from benchbackend.backends.registry import HEAP_KEPT  # noqa: E402 (no framework imported)

for _var, _value in HEAP_KEPT.items():
    os.environ.setdefault(_var, _value)  # the processes the tests start (glibc reads them at start)
if sys.platform.startswith("linux"):  # this process, already started: glibc's mallopt
    import ctypes

    _libc = ctypes.CDLL(None)
    _libc.mallopt(-1, int(HEAP_KEPT["MALLOC_TRIM_THRESHOLD_"]))  # M_TRIM_THRESHOLD
    _libc.mallopt(-3, int(HEAP_KEPT["MALLOC_MMAP_THRESHOLD_"]))  # M_MMAP_THRESHOLD

#: The slowest test files (by the sum of their tests' --durations, measured 2026-11-27 in CI's
#: command), which collection puts first: ``--dist loadfile`` hands whole files to the two test
#: processes in collection order, so a heavy file collected last ran alone at the end while the
#: other process sat idle (alphabetically, the ViT files came last).
HEAVY_FIRST = ("test_decoder_jax.py", "test_generation_keras.py", "test_vit_backends.py", "test_keras3.py",
               "test_generation_torch.py", "test_contract.py", "test_generation_jax.py",
               "test_ray_train.py", "test_graph_backends.py", "test_decoder_keras.py", "test_ray_nodes.py",
               "test_decoder_torch.py", "test_replicas_keras.py", "test_replicas.py", "test_plaidml.py",
               "test_report_text.py", "test_jax.py", "test_peaks.py", "test_fast_modes.py",
               "test_replicas_jax.py", "test_vit_onnx.py", "test_tvm.py", "test_vit_torch.py", "test_vit_jax.py")

#: The ONNX Runtime/OpenVINO tests run in a pytest of their own (tests/test_isolated.py starts it,
#: setting BENCHBACKEND_ISOLATED): this session does not collect them, rather than skip them.
collect_ignore = [] if os.environ.get("BENCHBACKEND_ISOLATED") else ["test_onnx_runtimes.py"]

#: CI sets this: a test that would skip because a framework or an isolated environment is missing
#: fails instead, so that a failed install cannot pass as a green run. GPU and TPU skips stay skips.
REQUIRE_ALL = os.environ.get("BENCHBACKEND_REQUIRE_ALL") == "1"
#: What the reason of every "missing here" skip says (and what REQUIRE_ALL turns into a failure).
MISSING = ("is not installed", "cannot build the")


def mnist_with_target(folder: Path, name: str, target: float) -> Path:
    """mnist's workload file under another ``name`` in ``folder``, with ``checks.target_accuracy``
    set (time to accuracy, epochs to target)."""
    import yaml

    spec = yaml.safe_load((ROOT / "workloads" / "mnist.yaml").read_text())
    spec["name"], spec["checks"]["target_accuracy"] = name, target
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def numeric_grad(f, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of ``f`` (no arguments, a float) over every entry of ``w``, which is
    perturbed in place and restored."""
    g = np.zeros_like(w)
    for idx in np.ndindex(w.shape):
        old = w[idx]
        w[idx] = old + eps
        up = f()
        w[idx] = old - eps
        down = f()
        w[idx] = old
        g[idx] = (up - down) / (2 * eps)
    return g


def have(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def missing(backend: str) -> str:
    """Why the registry backend ``backend`` cannot run here, with its install command ("" if it can)."""
    from benchbackend.backends import registry as backends

    spec = backends.get(backend)
    why = backends.problem(spec)
    return f"{backend} is not installed here ({why}): {spec.install}" if why else ""


def requires(backend: str) -> pytest.MarkDecorator:
    """Skip unless ``backend`` can run here, saying what is missing and the install command (a
    failure under BENCHBACKEND_REQUIRE_ALL=1)."""
    return pytest.mark.skipif(bool(missing(backend)), reason=missing(backend))


def backend_params(names, *, build_isolated: bool = False) -> list:
    """``names`` as pytest params, each skipped (with the reason) where it cannot run here.
    ``build_isolated``: a backend of an isolated environment is not skipped for an environment not
    yet built, since the test builds it (``isolated_env``)."""
    from benchbackend.backends import registry as backends

    def marks(n):
        return [] if build_isolated and backends.get(n).isolated_env else requires(n)

    return [pytest.param(n, marks=marks(n)) for n in names]


def isolated_env(envs_root: Path, backend: str) -> dict[str, str]:
    """The worker environment variables under which ``backend`` runs: for a backend of an isolated
    environment, that environment built (or reused) under ``envs_root`` and named to the CLI."""
    from benchbackend.backends import envs
    from benchbackend.backends import registry as backends

    spec = backends.get(backend)
    if not spec.isolated_env:
        return {}
    built_env(envs_root, spec.isolated_env, envs.Probe(spec.name, spec.target, spec.env("cpu")), backend)
    return {"BENCHBACKEND_ENVS": str(envs_root)}


requires_torch = requires("torch")
requires_tf = requires("tensorflow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files of ``HEAVY_FIRST`` first, in its order; every other file after them, as collected
    (a stable sort: a file's tests keep their order)."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_ALL and report.skipped and any(m in str(report.longrepr) for m in MISSING):
        report.outcome = "failed"
        report.longrepr = f"BENCHBACKEND_REQUIRE_ALL=1 and this would have skipped: {report.longrepr}"


def ctrl_c_reaches_it() -> None:
    """``preexec_fn`` for a child that a test stops with SIGINT as Ctrl-C at a terminal would: a test
    run started in the background by a shell without job control inherits SIGINT ignored (Python
    keeps an ignored SIGINT), and a thread of a library may have it blocked in the mask a fork copies."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def cli(*args: str, cwd: Path | None = None, timeout: float = 900, env: dict | None = None):
    """Run the real CLI as a subprocess (python -m benchbackend)."""
    import subprocess

    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "benchbackend", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=timeout, env=full_env)


def invoke(*args: str):
    """The CLI in this process (usage and configuration errors need no worker)."""
    from click.testing import CliRunner

    from benchbackend.cli import main

    return CliRunner().invoke(main, list(args))


def one_line_error(result) -> str:
    """The one line a usage error prints (click's runner mixes stderr into output)."""
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error:"), result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture(scope="session")
def envs_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the isolated environments (PlaidML, Chainer) are built once and reused across runs:
    $BENCHBACKEND_ENVS if set, else pytest's cache folder (.pytest_cache/d/benchbackend-envs)."""
    if os.environ.get("BENCHBACKEND_ENVS"):  # made if need be, as the product makes its own
        root = Path(os.environ["BENCHBACKEND_ENVS"])
        root.mkdir(parents=True, exist_ok=True)
        return root
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("benchbackend-envs") if cache else tmp_path_factory.mktemp("envs")


def make_job(tmp_path: Path, w, backend: str = "numpy", *, target: str | None = None, **fields):
    """The ``launch.Job`` of one repeat of ``backend`` (a registry name) on ``w``, with the run's arrays
    written to ``tmp_path``; ``target`` runs another adapter class under that backend's entry, and
    ``fields`` are the job's own (mode, precision, device, parity_steps, options, trains, ...)."""
    from dataclasses import replace

    from benchbackend.backends import registry as backends
    from benchbackend.run.launch import Job

    job = Job.for_spec(backends.get(backend), w, data=job_arrays(tmp_path, w), **fields)
    return replace(job, target=target) if target else job


def run_cell(tmp_path: Path, w, backend: str = "numpy", **fields) -> tuple[list[dict], list[dict]]:
    """One cell in this process through ``worker.run_job``: (every message, the rows with the
    trajectory decided as the runner decides it)."""
    from benchbackend.run import checks, worker

    msgs: list[dict] = []
    worker.run_job(make_job(tmp_path, w, backend, **fields), msgs.append)
    rows = [checks.trajectory(m, w) if m.get("losses") is not None else m for m in msgs if m.get("type") == "row"]
    return msgs, rows


from support.forks import Forks  # noqa: E402

#: This test process's preloaded workers (``support.forks``), closed when the session ends.
FORKS = Forks()


@pytest.fixture(scope="session", autouse=True)
def _close_forks():
    yield
    FORKS.close()


def spawn_cell(tmp_path: Path, w, backend: str = "numpy", *, env: dict | None = None, timeout: float = 900,
               **fields):
    """One cell in a real worker process (for backends whose environment must be set before the
    framework is imported): (the rows with the trajectory decided, the worker's ``Outcome``, its
    ``messages.Info`` or None). ``env`` replaces the worker environment the registry entry gives."""
    from benchbackend.backends import registry as backends
    from benchbackend.run import checks, launch, plan
    from benchbackend.run.messages import Info, Row

    job = make_job(tmp_path, w, backend, **fields)
    spec = backends.get(backend)
    cell = plan.Cell(w, plan.Choice(backend, job.mode, job.precision), job.repeat, 1, 0)
    messages = launch.stream(cell, launch.python_for(spec), env or launch.worker_environ(spec, job.device), job,
                             timeout, preloaders=FORKS)
    rows, info = [], None
    while True:
        try:
            msg = next(messages)
        except StopIteration as stop:
            return rows, stop.value, info
        if isinstance(msg, Row):
            row = dict(msg.fields)
            rows.append(checks.trajectory(row, w) if row.get("losses") is not None else row)
        info = msg if isinstance(msg, Info) else info


def job_arrays(tmp_path: Path, w) -> str:
    """The run's arrays as the runner hands them to a worker (an .npz of synthetic data and orders),
    in ``tmp_path``, named by the workload's hash."""
    from benchbackend.data import arrays

    path = tmp_path / f"{w.name}-{w.hash()}.npz"
    arrays.prepare(w, "synthetic", None, path)
    return str(path)


def built_env(envs_root: Path, name: str, probe, label: str):
    """The isolated environment ``name`` built (or reused) under ``envs_root``; skips, saying why, where
    it cannot be built here (no package index, no wheel, no venv)."""
    import fcntl
    from unittest import mock

    from benchbackend.backends import envs
    from benchbackend.errors import EnvError

    # Two xdist processes may want the same environment at once (a backend's own file and the
    # contract test): one builds it, the other waits and then reuses it.
    with open(envs_root / f".{name}.lock", "w") as lock, \
            mock.patch.dict(os.environ, {"BENCHBACKEND_ENVS": str(envs_root)}):
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            st = envs.setup(name, probe)
        except EnvError as exc:
            if str(exc).startswith(("pip install", "creating the")):
                pytest.skip(f"cannot build the {label} env here: {exc}")
            raise
    assert st.ready, st.message
    return st


def _registered(trains: bool) -> list[str]:
    from benchbackend.backends import registry

    return [name for name, spec in registry.BACKENDS.items() if spec.trains == trains]


#: Every backend that trains, and the inference-only runtimes, from the registry (in its order): a
#: new backend joins the cross-backend parity tests by its registry entry alone.
TRAINING = _registered(True)
INFERENCE = _registered(False)
#: Backends whose cells may run in this process (an allowlist: a new one runs in a worker process,
#: which is always safe); the others need a worker of their own (Keras picks its framework on
#: import; OpenVINO beside other frameworks once crashed a process).
IN_PROCESS = {"numpy", "torch", "tensorflow", "jax"}


def _isolated_cell(tmp_path: Path, w, backend: str, env, **fields) -> list[dict]:
    import json

    from benchbackend.backends import envs
    from benchbackend.backends import registry as backends
    from benchbackend.run import checks

    spec = backends.get(backend)
    job = make_job(tmp_path, w, backend, **fields)
    proc = FORKS.run(env.python, {**envs.worker_env(), **spec.env(job.device)}, job)
    msgs = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 0 and not [m for m in msgs if m.get("type") == "error"], proc.stderr[-3000:]
    rows = [m for m in msgs if m.get("type") == "row"]
    return [checks.trajectory(r, w) if r.get("losses") is not None else r for r in rows]


def any_cell(tmp_path: Path, w, backend: str, envs_root: Path, **fields) -> list[dict]:
    """The rows of one cell of ``backend`` (the trajectory decided), run where that backend must run:
    in this process, in a worker process, or in its isolated environment's interpreter (built under
    ``envs_root`` if need be)."""
    from benchbackend.backends import envs
    from benchbackend.backends import registry as backends

    if backend in IN_PROCESS:
        return run_cell(tmp_path, w, backend, **fields)[1]
    spec = backends.get(backend)
    if spec.isolated_env:
        label = {"plaidml": "PlaidML", "chainer": "Chainer"}.get(backend, backend)
        env = built_env(envs_root, backend, envs.Probe(backend, spec.target, spec.env("cpu")), label)
        return _isolated_cell(tmp_path, w, backend, env, **fields)
    rows, outcome, _ = spawn_cell(tmp_path, w, backend, **fields)
    assert outcome.status == "done", outcome
    return rows
