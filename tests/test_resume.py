"""``run --resume``: an interrupted run finishes into the same file, each cell once."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from benchbackend import results
from benchbackend.run import resume
from conftest import ROOT, cli, ctrl_c_reaches_it, invoke, one_line_error

RUN = ["run", "mnist", "-b", "numpy", "--data", "synthetic", "--limit", "256", "--epochs", "2", "--repeats", "6",
       "--no-plots", "-q"]


def _cells(path: Path) -> pd.DataFrame:
    df = results.read(path)
    return df[df["phase"] == "run"]


def _interrupt_after_two_cells(out: Path) -> tuple[subprocess.Popen, str, bool]:
    """Start the run, Ctrl-C it once two cells have ended: (the process, its stderr, whether it had
    ended on its own before the signal went)."""
    proc = subprocess.Popen([sys.executable, "-m", "benchbackend", *RUN, "-o", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_reaches_it)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:  # stop it once two cells have ended
        if out.exists() and sum(1 for line in out.read_text().splitlines() if ",run," in line) >= 2:
            break
        time.sleep(0.05)
    ended = proc.poll() is not None
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    # A test starved for the seconds the last cells took reads two ended cells only as the run exits:
    # the signal then finds it past its cells (exit 0), which is the same as having ended first.
    return proc, err, ended or proc.returncode == 0


def test_an_interrupted_run_resumes_to_one_complete_file_without_duplicates(tmp_path: Path) -> None:
    out = tmp_path / "r.csv"
    proc, err, ended = _interrupt_after_two_cells(out)
    for _ in range(2):  # this test's process was starved for the seconds the run needed (a busy CI): again
        if not ended:
            break
        out.unlink()
        proc, err, ended = _interrupt_after_two_cells(out)
    assert not ended, f"the run ended before the test could interrupt it: {err[-2000:]}"
    assert proc.returncode == 130, err
    assert f"--resume {out}" in err
    first = _cells(out)
    done = first[first["status"] == "ok"]
    assert 2 <= len(done) < 6, first[["repeat", "status"]]
    before = results.read(out)
    kept = before[before["run_id"].isin(done["run_id"]) & before["repeat"].isin(done["repeat"])]

    again = cli(*[a for a in RUN if a != "-q"], "--resume", str(out))
    assert again.returncode == 0, again.stderr
    assert f"resuming {out}: {len(done)} of 6 cells had finished" in again.stdout + again.stderr
    after = results.read(out)
    cells = after[after["phase"] == "run"]
    assert sorted(cells["repeat"]) == [1, 2, 3, 4, 5, 6] and set(cells["status"]) == {"ok"}
    # each repeat's epochs and passes once; the interrupted cell's partial rows are gone
    timed = after[after["phase"].isin(["train_epoch", "inference"])]
    assert not timed.duplicated(["repeat", "phase", "epoch", "pass"]).any()
    assert len(timed[timed["phase"] == "train_epoch"]) == 6 * 2
    assert after["run_id"].nunique() == 2 and "interrupted" not in set(after["status"])
    # the finished cells' rows are the first run's, untouched
    ours = after[after["run_id"].isin(done["run_id"]) & after["repeat"].isin(done["repeat"])]
    assert _rows(ours) == _rows(kept)


def _rows(df: pd.DataFrame) -> list[tuple]:
    cols = ["run_id", "repeat", "phase", "epoch", "pass", "seconds", "timestamp", "status"]
    return sorted(map(tuple, df[cols].astype(str).to_numpy().tolist()))


def _write(path: Path, cells: dict[int, str], workload_hash: str = "h1", workload: str = "mnist") -> None:
    """Cells (repeat -> final status, or "pending": its parent was killed before its run row)."""
    writer = results.CsvWriter(path)
    for repeat, status in cells.items():
        base = dict(run_id="run1", cell_order=repeat - 1, workload=workload, workload_hash=workload_hash,
                    data_source="synthetic", backend="numpy", mode="reference", precision="fp32", device="cpu",
                    requested_device="cpu", inference_only=False, repeat=repeat)
        writer.write({**base, "phase": "train_epoch", "epoch": 1, "seconds": 1.0, "samples": 256})
        if status != "pending":
            writer.end_cell(base, status)


def _key(repeat: int) -> resume.CellKey:
    return resume.CellKey("h1", "synthetic", "numpy", "reference", "fp32", "cpu", False, repeat)


def test_finished_cells_are_the_final_statuses_and_prune_drops_only_the_rerun_ones(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    _write(path, {1: "ok", 2: "crashed", 3: "interrupted", 4: "pending"})
    previous = resume.read(path)
    assert previous.finished == {_key(1): "ok", _key(2): "crashed"}  # a final failure: not run again
    assert previous.definitions == {"mnist": {"h1"}}
    assert resume.prune(path, {_key(3)}) == 2 + 2 + 1  # cell 3's two rows go; pending cell 4 (not planned) stays
    left = pd.read_csv(path, dtype=str, keep_default_na=False)
    assert sorted(set(left["repeat"])) == ["1", "2", "4"]
    assert resume.prune(path, {_key(1), _key(4)}) == 4  # a finished cell is never dropped; cell 4 is
    assert sorted(set(pd.read_csv(path, dtype=str)["repeat"])) == ["1", "2"]


def test_resume_refuses_a_changed_definition_a_missing_file_and_other_outputs(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    _write(path, {1: "ok"}, workload_hash="0123456789abcdef")
    line = one_line_error(invoke(*RUN, "--resume", str(path)))
    assert "mnist was measured with another definition (hash 01234567)" in line
    assert "no such file" in one_line_error(invoke(*RUN, "--resume", str(tmp_path / "nope.csv")))
    other = invoke(*RUN, "--resume", str(path), "-o", str(tmp_path / "x.csv"))
    assert "leave out -o and --force" in one_line_error(other)
    old = tmp_path / "old.csv"  # a file without the last column (``pass``), as an older version wrote
    old.write_text("".join(line.rsplit(",", 1)[0] + "\n" for line in path.read_text().splitlines()))
    assert "cannot append to it" in one_line_error(invoke(*RUN, "--resume", str(old)))


def test_resume_refuses_a_file_of_other_workloads(tmp_path: Path, monkeypatch) -> None:
    from support import inprocess

    inprocess.use(monkeypatch)  # were it let through, its cells would run here
    path = tmp_path / "resnet20.csv"
    _write(path, {1: "ok", 2: "interrupted"}, workload="resnet20")
    before = path.read_text()
    line = one_line_error(invoke(*RUN, "--resume", str(path)))
    assert "resnet20" in line and "mnist" in line and "not this command's workloads" in line, line
    assert path.read_text() == before  # nothing appended, nothing pruned


def test_resuming_a_finished_file_quietly_says_nothing_is_left(tmp_path: Path, monkeypatch) -> None:
    from support import inprocess

    inprocess.use(monkeypatch)
    path = tmp_path / "done.csv"
    args = [*RUN[:RUN.index("--repeats")], "--repeats", "1", "--no-plots", "-q"]
    first = invoke(*args, "-o", str(path))
    assert first.exit_code == 0, first.output[-2000:]
    again = invoke(*args, "--resume", str(path))
    assert again.exit_code == 0, again.output[-2000:]
    assert f"resuming {path}: 1 of 1 cells had finished; nothing left to run" in again.stderr
    assert "summary" not in again.stdout  # no empty summary header over no cells


def test_an_unavailable_cell_runs_again_on_resume(tmp_path: Path, monkeypatch) -> None:
    """``unavailable`` is not final: the backend may have been installed since."""
    from support import inprocess

    path = tmp_path / "u.csv"
    _write(path, {1: "ok", 2: "unavailable"})
    assert resume.read(path).finished == {_key(1): "ok"}
    inprocess.use(monkeypatch)
    path = tmp_path / "run.csv"
    args = [*RUN[:RUN.index("--repeats")], "--repeats", "1", "-b", "openvino", "--precision", "fp64",
            "--no-plots", "-q"]  # openvino has no fp64 (and may not be installed): its cell is unavailable
    first = invoke(*args, "-o", str(path))
    assert first.exit_code == 1 and sorted(_cells(path)["status"]) == ["ok", "unavailable"], first.output[-2000:]
    again = invoke(*args, "--resume", str(path))
    assert f"resuming {path}: 1 of 2 cells had finished; running the rest" in again.stderr
    cells = _cells(path)
    assert sorted(cells["status"]) == ["ok", "unavailable"] and cells["run_id"].nunique() == 2, cells
