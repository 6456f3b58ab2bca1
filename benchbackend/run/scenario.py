"""MLPerf's inference scenarios, driven by MLPerf's LoadGen, inside the worker (``--scenario``;
docs/scenarios.md).

The system under test (SUT) is the adapter's inference on a query's samples: LoadGen's thread
hands a query to :class:`Sut`, which queues it for one serving thread (so a Server query that
arrives while another is served waits, as it would at a real server); that thread gathers the
query's samples from the test split already on the device (``Backend.take``), calls ``scores``,
brings the outputs to the host and syncs the device, and only then tells LoadGen the query is
complete. The sync is this module's, not the adapter's, as it is for every timed region. The query
sample library (QSL) is the test split, every sample of it loaded (placed before the clock by the
placement rule).

Before the timed runs, LoadGen's accuracy mode (``TestMode.AccuracyOnly``: every test sample
issued once, in the scenario's queries, each response's bytes logged to ``mlperf_log_accuracy.json``)
runs the same SUT once (:meth:`Scenario.accuracy`). Its outputs are compared with the NumPy
reference's on the test split (``top1_agreement``, and ``accuracy`` on the labels); outputs beyond
the precision's forward tolerance end the cell ``audit_failed``.

Each timed LoadGen run is one ``scenario`` row: LoadGen's latency percentiles, early-stopping
estimate, queries and samples per second, its own VALID/INVALID verdict, and the folder of its
summary and detail logs. A share of the timed responses (at least 1% and at least 100: every
100th, and a seeded reservoir over all of them) is audited against the accuracy-mode outputs of
the same samples (``checks.audit``, as MLPerf's TEST01 does): a backend that caches, skips or
returns stale outputs while timed ends ``audit_failed``. With ``slo_ms`` the Server's target rate
is searched (:func:`search`), each probe a LoadGen run and a row.

Over 400 lines: the SUT, LoadGen's settings and logs, the accuracy-mode run and the audit against
it, and the peak search are one protocol around one SUT and its LoadGen runs (the audit reads the
SUT's reservoir and the accuracy mode's outputs; the search reads the audited rows).
"""
from __future__ import annotations

import json
import queue
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

PHASE = "scenario"
LOADGEN = {"single-stream": "SingleStream", "multi-stream": "MultiStream", "server": "Server", "offline": "Offline"}
#: LoadGen's percentiles (its detail log's ``result_<p>_percentile_latency_ns``) -> our columns.
PERCENTILES = {"50.00": "latency_p50_ms", "90.00": "latency_p90_ms", "99.00": "latency_p99_ms",
               "99.90": "latency_p999_ms"}
#: Untimed calls of the query's shape before LoadGen starts: the first calls carry tracing and allocation.
WARMUP_CALLS = 3


@dataclass
class Reservoir:
    """The audited share of the timed responses, (sample index, output): a seeded uniform sample of
    ``least`` of them (Algorithm R) and every ``stride``-th (the first, the 101st, ...): at least
    ``least`` and at least 1 / ``stride`` of all offered, however many the run turns out to issue."""

    least: int
    seed: int
    stride: int = 100
    seen: int = 0
    sample: list[tuple[int, int, np.ndarray]] = field(default_factory=list)  # (response number, index, output)
    strided: list[tuple[int, int, np.ndarray]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng([self.seed % 2**32, 39])

    def offer(self, index: int, output: np.ndarray) -> None:
        got = (self.seen, index, output.copy())
        self.seen += 1
        if got[0] % self.stride == 0:
            self.strided.append(got)
        if len(self.sample) < self.least:
            self.sample.append(got)
            return
        j = int(self.rng.integers(self.seen))
        if j < self.least:
            self.sample[j] = got

    @property
    def kept(self) -> list[tuple[int, np.ndarray]]:
        both = {n: (i, out) for n, i, out in [*self.sample, *self.strided]}
        return [both[n] for n in sorted(both)]


class Sut:
    """The system under test: one serving thread that runs each query's samples through the adapter."""

    def __init__(self, cell: Any, chunk: int):
        self.cell, self.backend, self.chunk = cell, cell.backend, chunk
        self.x_host = cell.arrays["x_test"]
        self.x_dev = cell.on_device("test")
        self.reservoir: Optional[Reservoir] = None
        self.gathers = True  # the adapter gathers on the device (``Backend.take``); else copied from the host
        self.error: Optional[BaseException] = None

    def gather(self, idx: np.ndarray) -> Any:
        got = self.backend.take(self.x_dev, idx)
        if got is None:
            self.gathers = False
            got = self.backend.to_device(self.x_host[idx])
        return got

    def infer(self, idx: np.ndarray) -> np.ndarray:
        """The outputs of samples ``idx`` on the host, the device synced: what LoadGen gets."""
        b = self.backend
        out = b.to_host(b.scores(self.gather(idx), len(idx)))
        b.sync()
        return np.ascontiguousarray(out, np.float32)

    def answer(self, lg: Any, idx: np.ndarray, ids: Optional[Sequence[int]]) -> None:
        """Samples ``idx`` inferred, offered to the audit, and their responses made and sent to LoadGen
        as completed under their query sample ``ids`` (None: made, not sent; ``Scenario.warm``)."""
        out = self.infer(idx)
        if self.reservoir is not None:
            for i, k in enumerate(idx):
                self.reservoir.offer(int(k), out[i])
        row = out[0].nbytes if len(out) else 0
        responses = [lg.QuerySampleResponse(0 if ids is None else ids[i], out.ctypes.data + i * row, row)
                     for i in range(len(idx))]
        if ids is not None:
            lg.QuerySamplesComplete(responses)

    def serve(self, lg: Any, samples: list[Any]) -> None:
        idx = np.fromiter((s.index for s in samples), np.int64, len(samples))
        for start in range(0, len(idx), self.chunk):
            self.answer(lg, idx[start:start + self.chunk], [s.id for s in samples[start:start + self.chunk]])

    def run(self, lg: Any, settings: Any, logs: Path, reservoir: Optional[Reservoir]) -> tuple[dict[str, Any], float]:
        """One LoadGen run: (its detail log's values, wall seconds of the test)."""
        self.reservoir = reservoir
        work: queue.Queue = queue.Queue()

        def loop() -> None:
            while True:
                samples = work.get()
                if samples is None:
                    return
                try:
                    self.serve(lg, samples)
                except BaseException as exc:  # noqa: BLE001 - LoadGen waits for completions: answer, then raise
                    self.error = self.error or exc
                    lg.QuerySamplesComplete([lg.QuerySampleResponse(s.id, 0, 0) for s in samples])

        server = threading.Thread(target=loop, name="benchbackend-sut", daemon=True)
        server.start()
        sut = lg.ConstructSUT(lambda samples: work.put(list(samples)), lambda: None)
        n = len(self.x_host)
        qsl = lg.ConstructQSL(n, n, lambda s: None, lambda s: None)  # placed already: the placement rule
        out = lg.LogOutputSettings()
        out.outdir, out.copy_summary_to_stdout = str(logs), False
        log = lg.LogSettings()
        log.log_output, log.enable_trace = out, False
        logs.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            lg.StartTestWithLogSettings(sut, qsl, settings, log)
        finally:
            seconds = time.perf_counter() - start
            work.put(None)
            server.join()
            lg.DestroyQSL(qsl)
            lg.DestroySUT(sut)
            self.reservoir = None
        if self.error is not None:
            raise self.error
        return detail(logs / "mlperf_log_detail.txt"), seconds


def logged_outputs(path: Path, n: int) -> np.ndarray:
    """Every test sample's output from LoadGen's accuracy log (``mlperf_log_accuracy.json``: one entry
    per response, ``qsl_idx`` and the response's bytes as hex), as float32 (n, ...): a sample issued
    twice (MultiStream's last query is filled up) keeps its first. ValueError for a sample not logged."""
    got: dict[int, np.ndarray] = {}
    with open(path) as fh:
        for entry in json.load(fh):
            got.setdefault(int(entry["qsl_idx"]), np.frombuffer(bytes.fromhex(entry["data"]), np.float32))
    missing = sorted(set(range(n)) - set(got))
    if missing:
        raise ValueError(f"LoadGen's accuracy log {path} has no output for {len(missing)} test samples "
                         f"(the first: {missing[0]})")
    return np.stack([got[i] for i in range(n)])


def detail(path: Path) -> dict[str, Any]:
    """The values of LoadGen's detail log (``:::MLLOG {json}`` lines), by key (the last of each)."""
    values: dict[str, Any] = {}
    with open(path) as fh:
        for line in fh:
            if line.startswith(":::MLLOG "):
                entry = json.loads(line[len(":::MLLOG "):])
                values[entry["key"]] = entry["value"]
    return values


def settings(lg: Any, spec: Any, scenario: str, expected_s: float, rate: float, target_qps: Optional[float],
             bound_ms: float, samples: int, accuracy: bool = False) -> Any:
    """LoadGen's ``TestSettings`` of one performance run (``accuracy``: of the accuracy-mode run,
    every sample once). ``expected_s``: one query's latency and ``rate``: samples/s of back-to-back
    batches, both measured untimed (LoadGen sizes the run by them)."""
    s = lg.TestSettings()
    s.scenario = getattr(lg.TestScenario, LOADGEN[scenario])
    s.mode = lg.TestMode.AccuracyOnly if accuracy else lg.TestMode.PerformanceOnly
    s.min_duration_ms = int(round(spec.min_duration_s * 1000))
    s.min_query_count = spec.queries(scenario)
    s.performance_sample_count_override = samples
    ns = max(int(expected_s * 1e9 / 2), 1000)  # LoadGen pre-generates queries by it: too few and the run ends short
    s.single_stream_expected_latency_ns = ns
    s.multi_stream_expected_latency_ns = ns
    s.multi_stream_samples_per_query = spec.multistream_samples
    s.offline_expected_qps = max(2 * rate, 1.0)  # too few samples and the run ends short of min_duration
    if target_qps is not None:
        s.server_target_qps = target_qps
    s.server_target_latency_ns = int(bound_ms * 1e6)
    return s


def _number(values: dict[str, Any], key: str, scale: float = 1.0) -> Optional[float]:
    v = values.get(key)
    return None if v is None else float(v) * scale


def invalid_because(values: dict[str, Any]) -> str:
    """Why LoadGen called a run INVALID, from its detail log's ``result_*_met`` and early-stopping
    entries. Under a Server bound, a p99 below it is not enough: with few queries, LoadGen's early
    stopping allows almost none over it (at 662 queries it asked for ~500 more with 4 over)."""
    why = []
    if values.get("result_perf_constraints_met") is False:
        over = values.get("result_overlatency_query_count")
        why.append("latency bound not met" + (f" ({over} queries over it)" if over is not None else ""))
    if values.get("early_stopping_met") is False:
        text = " ".join(str(values.get("early_stopping_result") or "").replace("*", " ").split())
        why.append("early stopping not met" + (f" ({text})" if text else ""))
    for key, what in (("result_min_duration_met", "minimum duration"), ("result_min_queries_met", "minimum queries")):
        if values.get(key) is False:
            why.append(f"{what} not met")
    return "LoadGen INVALID: " + ("; ".join(why) if why else "see its summary log")


def figures(values: dict[str, Any], scenario: str, wall: float) -> dict[str, Any]:
    """The row's columns from LoadGen's detail log: percentiles (ms; a MultiStream query's), the
    early-stopping estimate, queries and samples per second, query and sample counts, LoadGen's
    verdict. ``wall``: the run's seconds, for the rates LoadGen's log does not give (MultiStream)."""
    out: dict[str, Any] = {col: _number(values, f"result_{p}_percentile_latency_ns", 1e-6)
                           for p, col in PERCENTILES.items()}
    out["latency_mean_ms"] = _number(values, "result_mean_latency_ns", 1e-6)
    early = next((values[k] for k in ("early_stopping_latency_ss", "early_stopping_latency_ms",
                                      "early_stopping_latency_ns") if values.get(k)), None)
    out["early_stopping_ms"] = None if early is None else float(early) * 1e-6
    per_query = int(values.get("generated_samples_per_query") or 1)
    count = values.get("result_query_count", values.get("generated_query_count"))
    out["query_count"] = None if count is None else float(count)
    out["samples"] = None if count is None else float(count) * per_query
    if scenario == "offline":
        qps = sps = _number(values, "result_samples_per_second")
    elif scenario == "server":
        qps = sps = _number(values, "result_completed_samples_per_sec")
    else:
        qps = _number(values, "result_qps_with_loadgen_overhead")
        if qps is None and count and wall > 0:
            qps = float(count) / wall
        sps = None if qps is None else qps * per_query
    out.update(qps=qps, samples_per_s=sps, samples_per_query=per_query,
               loadgen_valid=str(values.get("result_validity", "")).lower() or None)
    return out


class Scenario:
    """One repeat's scenario runs: measure what LoadGen needs to size them, the accuracy-mode run,
    the timed runs, each audited, emitted."""

    def __init__(self, cell: Any, base: dict[str, Any], memory: Callable[[Any], dict[str, Any]], logs: Path,
                 tag: str, weights: Optional[list[np.ndarray]] = None):
        import mlperf_loadgen as lg

        self.lg, self.cell, self.base, self.memory, self.logs, self.tag = lg, cell, base, memory, logs, tag
        self.weights = weights
        w = cell.workload
        self.spec, self.name = w.loadgen, w.loadgen.scenario
        self.per_query = {"multi-stream": self.spec.multistream_samples, "offline": w.inference.batch_size}.get(
            self.name, 1)
        self.sut = Sut(cell, self.per_query)
        self.n = len(cell.arrays["x_test"])
        hint = cell.backend.details().get("performance_hint")
        self.hint = None if hint is None else str(hint).split(".")[-1]
        #: The accuracy-mode run's outputs of every test sample, and what the row says of them.
        self.logged: Optional[np.ndarray] = None
        self.checked: dict[str, Any] = {}
        self.notes: list[str] = []

    def warm(self) -> tuple[float, float]:
        """Untimed: the query's shape a few times (warm-up), then (seconds of one query, samples/s),
        each query served as in the run, the audit's copies and the responses included: a backend
        that answers in microseconds spends most of a sample there, and LoadGen sizes an Offline
        run by this rate (from the inference alone, a cached backend's 0.2 s run took 17-21 s)."""
        rng = np.random.default_rng([self.cell.workload.seed % 2**32, 40])
        size = min(self.per_query, self.n)
        times = []
        self.sut.reservoir = Reservoir(100, self.cell.workload.seed)  # thrown away
        try:
            for _ in range(WARMUP_CALLS + 5):
                idx = rng.choice(self.n, size=size, replace=False)
                start = time.perf_counter()
                self.sut.answer(self.lg, idx, None)
                times.append(time.perf_counter() - start)
        finally:
            self.sut.reservoir = None
        one = float(np.median(times[WARMUP_CALLS:]))
        return one, size / one

    def reference(self) -> Optional[np.ndarray]:
        """The NumPy reference's outputs (float64) of the test split with the cell's weights (None
        where the adapter cannot give back weights it trained), kept in the logs' folder under a
        digest of the network, the weights and the inputs: the run's other cells of the same repeat
        (other backends, scenarios, precisions) read it rather than compute it again."""
        import hashlib
        import os

        from ..backends.numpy import reference

        weights = self.weights
        if weights is None:
            try:
                weights = [np.asarray(v) for v in self.cell.backend.get_weights()]
            except NotImplementedError:
                return None
        w, x = self.cell.workload, np.ascontiguousarray(self.cell.arrays["x_test"], np.float32)
        digest = hashlib.sha256(json.dumps([layer.model_dump(mode="json") for layer in w.model]).encode())
        for a in [*weights, x]:
            a = np.ascontiguousarray(a)
            digest.update(f"{a.dtype}{a.shape}".encode())
            digest.update(a.data)
        path = self.logs / "reference" / f"{digest.hexdigest()[:32]}.npy"
        if path.exists():
            return np.load(path)
        # In batches of the forward parity check's size, which every cell runs: the reference adds
        # nothing to the process's peak memory (``peak_rss_mb``) that the parity check did not.
        step = w.checks.parity_batch
        out = np.concatenate([reference.forward(w, weights, x[i:i + step].astype(np.float64), dtype=np.float64)
                              for i in range(0, len(x), step)])
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f"{path.stem}.{os.getpid()}.part.npy")
        np.save(part, out)
        os.replace(part, path)  # whole or absent, for a cell running beside this one
        return out

    def accuracy(self, expected_s: float, rate: float, target_qps: Optional[float], bound_ms: float) -> None:
        """LoadGen's accuracy mode: every test sample once, in the scenario's queries; its logged
        outputs are what the timed runs' audits compare with (``self.logged``), and against the NumPy
        reference they give ``top1_agreement``, ``accuracy`` (on the test labels) and, beyond the
        precision's tolerance, ``audit_failed`` (``self.checked``)."""
        from ..backends.base import accuracy
        from .checks import reference_mismatch, top1_agreement

        folder = self.logs / (self.tag + "-accuracy")
        s = settings(self.lg, self.spec, self.name, expected_s, rate, target_qps, bound_ms, self.n, accuracy=True)
        self.sut.run(self.lg, s, folder, None)
        self.logged = out = logged_outputs(folder / "mlperf_log_accuracy.json", self.n)
        out = out.reshape(self.n, *np.shape(self.cell.arrays["y_test"])[1:], -1)
        labels = self.cell.arrays["y_test"]
        self.checked = {"accuracy_log": str(folder), "accuracy": accuracy(out, labels) if len(labels) else None}
        ref = self.reference()
        if ref is None:
            self.notes.append("no top-1 agreement with the reference: the adapter cannot give back the weights "
                              "it trained")
            return
        ref = ref.reshape(out.shape) if ref.size == out.size else ref
        self.checked["top1_agreement"] = top1_agreement(out, ref)
        tol = self.cell.workload.checks.tolerance(self.cell.backend.precision)
        found = reference_mismatch(out, ref, tol.rtol, tol.atol)
        if found is not None:
            self.checked["audit_sample"] = sample = found[0]
            self.notes.append(f"{self.name} accuracy-mode run, test sample {sample}: {found[1]}")

    def one(self, target_qps: Optional[float], bound_ms: float, expected_s: float, rate: float,
            probe: Optional[int] = None) -> dict[str, Any]:
        """One timed LoadGen run, audited against the accuracy-mode outputs, as a row (emitted)."""
        from .checks import audit

        folder = self.logs / (self.tag + (f"-probe{probe:02d}" if probe is not None else ""))
        s = settings(self.lg, self.spec, self.name, expected_s, rate, target_qps, bound_ms, self.n)
        reservoir = Reservoir(100, self.cell.workload.seed)
        values, wall = self.sut.run(self.lg, s, folder, reservoir)
        row = {**self.base, "phase": PHASE, "scenario": self.name,
               "target_qps": target_qps if self.name == "server" else None,
               "latency_bound_ms": bound_ms if self.name == "server" else None,
               "below_mlperf_minimum": self.spec.below_mlperf_minimum, "loadgen_log": str(folder),
               "performance_hint": self.hint, "probe": probe, **figures(values, self.name, wall), **self.checked}
        row["seconds"] = (row["samples"] / row["samples_per_s"]) if row["samples"] and row["samples_per_s"] else wall
        notes = list(self.notes)
        kept = reservoir.kept
        row["audited"] = len(kept)
        if kept and self.logged is not None:
            idx = np.array([k for k, _ in kept])
            tol = self.cell.workload.checks.tolerance(self.cell.backend.precision)
            found = audit(np.stack([o for _, o in kept]).reshape(len(kept), -1), self.logged[idx], tol.rtol, tol.atol)
            if found is not None:
                sample = int(idx[found[0]])
                row["audit_sample"] = row.get("audit_sample", sample)
                notes.append(f"{self.name} run{'' if probe is None else f' (probe {probe})'}, test sample {sample}: "
                             f"{found[1]} from the accuracy-mode run's output")
        if row.get("loadgen_valid") == "invalid":
            notes.append(invalid_because(values))
        if len(kept) < 100:
            notes.append(f"{len(kept)} timed responses audited (fewer than 100 in the run)")
        if not self.sut.gathers:
            notes.append("each query's samples copied from the host inside the clock (the adapter has no on-device "
                         "gather)")
        if self.spec.below_mlperf_minimum:
            notes.append(f"below MLPerf's minimum ({self.spec.min_duration_s:g} s, {self.spec.queries(self.name)} "
                         f"queries asked): not a compliant result")
        row["notes"] = "; ".join(notes)
        row.update(self.memory(self.cell.backend), **self.cell.load)
        self.cell.emit(row)
        return row

    def run(self) -> None:
        expected_s, rate = self.warm()
        bound = self.spec.slo_ms or self.spec.server_latency_ms
        # One sample at a time sustains 1 / expected_s queries/s: the default offered rate is half of it.
        single = 1.0 / expected_s
        start = self.spec.server_target_qps or 0.5 * single
        # The accuracy run's latencies are no figure: a Server's arrivals come at the one-at-a-time rate.
        self.accuracy(expected_s, rate, max(start, single), bound)
        if self.name != "server":
            self.one(None, bound, expected_s, rate)
            return
        if self.spec.slo_ms is None or self.checked.get("audit_sample") is not None:
            self.one(start, bound, expected_s, rate)  # a failed accuracy run: one probe says so, no search
            return
        search(lambda qps, k: self.one(qps, bound, expected_s, rate, probe=k), start=start,
               precision=self.spec.search_precision)


def valid(row: dict[str, Any]) -> bool:
    """LoadGen called the run VALID and the audit passed."""
    return row.get("loadgen_valid") == "valid" and row.get("audit_sample") is None


def search(probe: Callable[[float, int], dict[str, Any]], start: float, precision: float = 0.02,
           most: int = 24) -> Optional[float]:
    """The highest target QPS LoadGen calls valid, bracketed within ``precision`` (relative): double
    (or halve) from ``start`` until the bracket holds a valid rate below an invalid one, then bisect.
    Each probe is a LoadGen run (``probe(qps, k)``); returns the best valid rate (None: none was)."""
    k = 0

    def ok(qps: float) -> bool:
        nonlocal k
        k += 1
        return valid(probe(qps, k))

    low: Optional[float] = None
    high: Optional[float] = None
    qps = start
    while k < most and (low is None or high is None):
        if ok(qps):
            low = qps
            qps *= 2
        else:
            high = qps
            qps /= 2
        if low is not None and high is not None:
            break
    while low is not None and high is not None and k < most and (high - low) > precision * low:
        mid = (low + high) / 2
        if ok(mid):
            low = mid
        else:
            high = mid
    return low


def tag(job: Any) -> str:
    """A repeat's name in its run's LoadGen folder."""
    w = job.workload
    return f"{w.name}-{w.loadgen.scenario}-{job.backend}-{job.mode}-{job.precision}-r{job.repeat}"


def run(cell: Any, base: dict[str, Any], memory: Callable[[Any], dict[str, Any]], job: Any,
        weights: Optional[list[np.ndarray]] = None) -> None:
    """The inference phase of ``job``'s repeat as its workload's scenario (``loadgen.scenario``);
    ``weights``: the network's, when untrained (else the adapter's ``get_weights``)."""
    from importlib.util import find_spec

    if find_spec("mlperf_loadgen") is None:
        cell.emit({"type": "unavailable", "message": "--scenario needs MLPerf's LoadGen: pip install "
                                                     "'benchbackend[loadgen]' (mlcommons-loadgen)"})
        return
    if job.options.loadgen_dir:  # the run's ``<csv stem>-loadgen`` folder, kept beside its CSV
        Scenario(cell, base, memory, Path(job.options.loadgen_dir), tag(job), weights=weights).run()
        return
    with tempfile.TemporaryDirectory(prefix="benchbackend-loadgen-") as logs:  # nobody reads them
        Scenario(cell, base, memory, Path(logs), tag(job), weights=weights).run()
