"""Data parallel (``--replicas N``, issue 22): the semantics (``benchbackend.spec.replicas``), the matrix
dimension and its CSV column, and replica parity on real DistributedDataParallel processes over
gloo, where each planted trap (summed gradients, lr times N, overlapping shards, a dropped
remainder) must end ``parity_mismatch`` while the honest adapter on the same cell ends ``ok``.

The trap adapters are classes of this module: the spawned replicas import them by name."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from support import replica_traps

from benchbackend.cli import main
from benchbackend.run import checks, plan, truth
from benchbackend.spec import replicas, workload
from conftest import one_line_error, requires_torch, run_cell

# --- the semantics, no framework -------------------------------------------------------------------


@pytest.mark.parametrize("size, n", [(32, 2), (9, 2), (10, 4), (3, 4), (1, 2), (128, 8)])
def test_shards_are_contiguous_disjoint_cover_the_batch_and_weigh_to_its_mean(size, n):
    spans = replicas.shards(size, n)
    assert len(spans) == n and spans[0][0] == 0 and spans[-1][1] == size
    assert all(a == prev_b for (_, prev_b), (a, _) in zip(spans, spans[1:]))  # contiguous, no overlap, no gap
    counts = [b - a for a, b in spans]
    assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)
    w = replicas.weights(size, n)
    # The engine averages N weighted gradients: each sample's share of the average is 1 / size.
    assert sum(wr / n for wr in w) == pytest.approx(1.0)
    assert all(wr / n / max(c, 1) == pytest.approx(1 / size) for wr, c in zip(w, counts) if c)
    if size % n == 0:
        assert w == [1.0] * n  # a full batch: plain DDP averaging


def test_threads_are_split_between_replicas():
    assert replicas.threads_per_replica(None, 1) is None and replicas.threads_per_replica(4, 1) == 4
    assert replicas.threads_per_replica(4, 2) == 2 and replicas.threads_per_replica(2, 4) == 1


def test_more_replicas_than_threads_on_a_cpu_is_said_before_the_run():
    assert replicas.oversubscribed([1, 2], None, "cpu", 2) == []
    assert replicas.oversubscribed([1, 2, 4], None, "cpu", 2) == [
        "--replicas 4 on 2 CPU threads: each replica still takes one, so 4 threads contend for 2 and the scaling "
        "measures that contention"]
    assert len(replicas.oversubscribed([4], 8, "cpu", 2)) == 0  # --threads is the budget
    assert replicas.oversubscribed([4], None, "gpu", 2) == []  # one GPU per replica


def test_scale_lr_linear_multiplies_the_lr_only_when_asked():
    w = workload.load("mnist")
    assert replicas.scaled(w, 4, "none") is w and replicas.scaled(w, 1, "linear") is w
    assert replicas.scaled(w, 4, "linear").training.lr == pytest.approx(4 * w.training.lr)


def test_a_batch_that_does_not_split_is_one_line_and_exit_2(tmp_path):
    out = tmp_path / "r.csv"
    result = CliRunner().invoke(main, ["run", "mnist", "-b", "numpy", "--replicas", "1", "--replicas", "3",
                                       "--data", "synthetic", "-o", str(out)])
    assert "batch size 32 does not split evenly over --replicas 3" in one_line_error(result)
    assert not out.exists()  # nothing ran


def test_replicas_with_inference_only_is_one_line_and_exit_2(tmp_path):
    # Inference runs on replica 0 alone: an "x2" inference cell would time one device under N's name.
    out = tmp_path / "r.csv"
    result = CliRunner().invoke(main, ["run", "mnist", "-b", "numpy", "--replicas", "2", "--inference-only",
                                       "--data", "synthetic", "-o", str(out)])
    assert "--replicas 2 trains data-parallel replicas and --inference-only trains nothing" in one_line_error(result)
    assert not out.exists()


def test_replicas_are_a_matrix_dimension_and_a_backend_without_an_engine_is_unavailable():
    choices = plan.with_replicas(plan.resolve(["numpy", "torch"], [], ["fp32"]), [1, 2])
    assert [(c.backend, c.replicas) for c in choices] == [("numpy", 1), ("numpy", 2), ("torch", 1), ("torch", 2)]
    problems = {(c.backend, c.replicas): c.problem for c in choices}
    assert "numpy: --replicas 2 (data parallel) is not implemented" in problems[("numpy", 2)]
    assert problems[("numpy", 1)] == problems[("torch", 1)] == problems[("torch", 2)] == ""
    assert plan.with_replicas(choices[:1], []) == choices[:1]  # no --replicas: one replica


def test_the_csv_records_replicas_and_an_unavailable_row_says_why(monkeypatch, tmp_path):
    from support import inprocess

    inprocess.use(monkeypatch)
    out = tmp_path / "r.csv"
    got = CliRunner().invoke(main, ["run", "mnist", "-b", "numpy", "--replicas", "1", "--replicas", "2",
                                    "--data", "synthetic", "--limit", "200", "--epochs", "1", "--repeats", "1",
                                    "--no-plots", "--quiet", "-o", str(out)])
    assert got.exit_code == 1, got.output[-2000:]  # the unavailable cell fails the run
    raw = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert set(raw["replicas"]) == {"1", "2"} and set(raw["scale_lr"]) == {"none"}
    two = raw[raw["replicas"] == "2"]
    assert two["phase"].tolist() == ["run"] and two["status"].tolist() == ["unavailable"]
    # The end-of-run summary names the two cells apart, as their log lines do.
    assert "numpy:reference/fp32 x2" in got.output and "numpy:reference/fp32    " in got.output
    said = two["message"].iloc[0]
    # It names every backend that has an engine (the registry's, not a fixed list).
    assert "not implemented for this backend yet" in said and said.endswith(
        "backends with a data-parallel engine: torch, tensorflow, jax, keras-jax")
    one = raw[raw["replicas"] == "1"]
    assert "train_epoch" in set(one["phase"]) and "unavailable" not in set(one["status"])  # it ran


# --- real DDP: replica parity and its traps -----------------------------------------------------------

#: 105 samples at a global batch of 32: three full batches and a last one of 9, which two replicas
#: split 5 + 4; 4 trajectory steps reach it. A larger lr than mnist's makes a wrong step show.
SAMPLES, BATCH, STEPS = 105, 32, 4


def _workload(lr: float = 0.05, batchnorm: bool = False):
    w = workload.load("mnist").with_overrides(limit=SAMPLES, epochs=1, batch_size=BATCH)
    w = w.model_copy(update={"training": w.training.model_copy(update={"lr": lr})})
    if batchnorm:
        raw = w.model_dump(mode="json")
        raw["model"].insert(1, {"type": "batchnorm"})
        w = workload.Workload.model_validate(raw)
    return w


def _cell(tmp_path: Path, w, n: int, target: str | None = None, scale_lr: str = "none"):
    """(status, message, rows) of one torch cell of ``n`` replicas, one thread each."""
    from benchbackend.run.plan import Options

    fields = {"target": f"test_replicas:{target}"} if target else {}
    msgs, rows = run_cell(tmp_path, w, "torch", parity_steps=STEPS,
                          options=Options(replicas=n, threads=1, scale_lr=scale_lr), **fields)
    assert not [m for m in msgs if m.get("type") in ("error", "unavailable")], msgs
    status, message = checks.cell_status(rows, w)
    return status, message, rows


def _trajectory(rows: list[dict]) -> dict:
    return next(r for r in rows if r.get("phase") == "parity" and r.get("steps"))


@requires_torch
@pytest.mark.slow
def test_two_ddp_replicas_train_the_single_replica_network(tmp_path):
    w = _workload()
    one = _cell(tmp_path, w, 1)
    two = _cell(tmp_path, w, 2)
    assert one[0] == "ok" and two[0] == "ok", (one[1], two[1])
    assert _trajectory(two[2])["parity_step"] is None and _trajectory(two[2])["steps"] == STEPS
    build = next(r for r in two[2] if r["phase"] == "build")
    assert "replicas 2 (DistributedDataParallel, gloo)" in build["notes"]
    # Every sample once per epoch, the short last batch included: the epoch's loss and accuracy
    # are the single-replica run's.
    e1, e2 = (next(r for r in c[2] if r["phase"] == "train_epoch") for c in (one, two))
    assert e2["loss"] == pytest.approx(e1["loss"], rel=1e-5) and e2["accuracy"] == pytest.approx(e1["accuracy"])
    assert e2["samples"] == SAMPLES


@requires_torch
@pytest.mark.slow
def test_scale_lr_linear_is_checked_against_the_reference_at_that_lr(tmp_path):
    status, message, rows = _cell(tmp_path, _workload(), 2, scale_lr="linear")
    assert status == "ok", message


@requires_torch
@pytest.mark.slow
def test_batchnorm_uses_per_replica_statistics_and_the_reference_does_too(tmp_path):
    from benchbackend.spec.model import initial_weights

    w = _workload(lr=0.01, batchnorm=True)  # mnist's own lr (at 0.05 step 4 drifts by 1.5e-3: see the report)
    status, message, rows = _cell(tmp_path, w, 2)
    assert status == "ok", message
    # The check means something: per-shard batch statistics give another trajectory than one batch's.
    trajectory = _trajectory(rows)
    assert trajectory["parity_step"] is None
    x = np.random.default_rng(0).random((BATCH, 28, 28, 1)).astype(np.float32)
    x[:BATCH // 2] *= 0.2  # the two shards' statistics differ
    y = np.arange(BATCH) % 10
    weights = initial_weights(w, 1)
    single = truth.trajectory(w, weights, [(x, y)] * 2)
    sharded = truth.sharded_losses(w, weights, [(x, y)] * 2, 2)
    assert abs(sharded[0] - single[0]) > 1e-3 * single[0]


# The traps: each is a plausible data-parallel bug, planted in the real adapter.
try:
    import torch
    import torch.distributed as dist

    from benchbackend.backends.torch.replicas import TorchDDPBackend
except ImportError:  # torch absent: the tests that use them skip
    TorchDDPBackend = object


class ThreadsSeen(TorchDDPBackend):
    """The honest adapter, noting replica 0's intra-op threads in each phase (the cell runs in this process)."""

    seen: list = []

    def scores(self, x, batch_size):
        out = super().scores(x, batch_size)
        ThreadsSeen.seen.append(("alone", torch.get_num_threads()))
        return out

    def _epoch(self, order):
        ThreadsSeen.seen.append(("training", torch.get_num_threads()))
        return super()._epoch(order)

    def _steps(self, batches):
        ThreadsSeen.seen.append(("training", torch.get_num_threads()))
        return super()._steps(batches)


@requires_torch
@pytest.mark.slow
def test_replica_0_trains_on_its_share_of_the_threads_and_runs_inference_alone_on_all_of_them(tmp_path):
    # Two replicas of one thread each: replica 0 trains on 1 thread, while the passes it runs alone
    # (parity, validation, inference) get both, as one device would: an "x2" inference is not half a CPU.
    ThreadsSeen.seen.clear()
    status, message, rows = _cell(tmp_path, _workload(), 2, target="ThreadsSeen")
    assert status == "ok", message
    phases = {phase for phase, _ in ThreadsSeen.seen}
    assert phases == {"alone", "training"}
    assert {n for phase, n in ThreadsSeen.seen if phase == "training"} == {1}
    assert {n for phase, n in ThreadsSeen.seen if phase == "alone"} == {2}
    assert {r["threads"] for r in rows if r.get("threads") is not None} <= {1}  # the column: per replica


def _allreduce_sum(state, bucket):
    """A DDP comm hook that sums the replicas' gradients instead of averaging them."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


class SummedGradients(TorchDDPBackend):
    def _wrap(self):
        super()._wrap()
        self.ddp.register_comm_hook(None, _allreduce_sum)


class LrTimesN(TorchDDPBackend):
    def build(self, weights):
        params = super().build(weights)
        for group in self.opt.param_groups:
            group["lr"] *= self.world  # scaled although --scale-lr was not asked
        return params


class OverlappingShards(TorchDDPBackend):
    def _split(self, size):
        return replica_traps.overlapping(size, self.world)


class DroppedRemainder(TorchDDPBackend):
    def _split(self, size):
        return replica_traps.dropped_remainder(size, self.world)


@requires_torch
@pytest.mark.slow
@pytest.mark.parametrize("trap", ["SummedGradients", "LrTimesN", "OverlappingShards", "DroppedRemainder"])
def test_each_planted_trap_is_caught_by_replica_parity(tmp_path, trap):
    status, message, rows = _cell(tmp_path, _workload(), 2, target=trap)
    assert status == "parity_mismatch", (trap, message)
    step = _trajectory(rows)["parity_step"]
    # A wrong update shows from the second step on; the dropped remainder only at the short last batch.
    expected = {"SummedGradients": 2, "LrTimesN": 2, "DroppedRemainder": STEPS}
    assert step == expected.get(trap, step) and step is not None, (trap, message)


def _two_replicas(cls: type) -> tuple:
    """``cls`` (a DDP adapter) for two replicas on one thread each, built from the shared weights,
    and the arrays whose ``set_data`` joins the group and wraps the model."""
    from benchbackend.spec.model import initial_weights

    w = _workload()
    rng = np.random.default_rng(0)
    ddp = cls(w, "cpu", options={"replicas": 2, "threads": 1})
    ddp.build(initial_weights(w, 1))
    return ddp, rng.random((SAMPLES, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, SAMPLES)


@requires_torch
@pytest.mark.slow
def test_comm_seconds_is_the_gradient_allreduce_time_since_the_last_call():
    import math
    import time

    ddp, x, y = _two_replicas(TorchDDPBackend)
    try:
        assert ddp.comm_seconds() is None  # no replicas yet: nothing is timed
        ddp.set_data(x, y)
        assert ddp.comm_seconds() == 0.0  # joined, wrapped: no gradient has been reduced yet
        start = time.perf_counter()
        ddp.to_host(ddp.train_epoch(np.arange(SAMPLES))[0])
        wall = time.perf_counter() - start
        seconds = ddp.comm_seconds()
        assert seconds is not None and math.isfinite(seconds) and 0 < seconds <= wall  # 4 steps' all-reduces
        assert ddp.comm_seconds() == 0.0  # since the last call
    finally:
        ddp.close()
    trap, x, y = _two_replicas(SummedGradients)
    try:  # a hook of the adapter's own stays (DDP takes one): nothing is timed
        trap.set_data(x, y)
        assert trap.comm_seconds() is None
    finally:
        trap.close()


@requires_torch
@pytest.mark.slow
def test_ddp_on_a_cpu_reduces_every_gradient_in_one_bucket():
    # docs/clusters.md "Data parallel on a CPU": gloo reduces on the replica's own core, so a bucket
    # reduced during the backward pass takes that core from it; one bucket measured faster. DDP's
    # default splits a 1 MiB first bucket off when it rebuilds its buckets after the first step.
    ddp, x, y = _two_replicas(TorchDDPBackend)
    try:
        ddp.set_data(x, y)  # joins the group and wraps the model
        caps = ddp.ddp._bucket_config  # DDP's record of the bucket sizes it was built with
        assert caps.first_bucket_bytes_cap == caps.bucket_bytes_cap == 25 * 2 ** 20
    finally:
        ddp.close()


def test_compare_keeps_n_replicas_apart_from_one():
    import pandas as pd

    from benchbackend.analysis import experiments

    rows = [{"status": "ok", "workload": "mnist", "workload_hash": "h", "data_source": "synthetic", "backend": "torch",
             "mode": "eager", "precision": "fp32", "requested_device": "cpu", "device": "cpu", "replicas": n,
             "phase": "train_epoch", "samples": 512, "epoch": 1} for n in (1, 2, 1)]
    out = experiments.for_comparison(pd.DataFrame(rows))
    assert out["mode"].tolist() == ["eager", "eager x2", "eager"]
    assert out.groupby(experiments.GROUP_KEYS).ngroups == 2
