"""``run --generate`` through the CLI (issue 38), on the reference's own cached path (no framework):
the rows a generation writes, a backend without a cache refused with its reason before any work,
and every bad input a one-line error before anything runs."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from benchbackend.cli import main


def _run(monkeypatch, tmp_path: Path, *args: str):
    from support import inprocess

    inprocess.use(monkeypatch)
    out = tmp_path / "r.csv"
    got = CliRunner().invoke(main, ["run", "gpt-nano", "--generate", "--data", "synthetic", "--limit", "32",
                                    "--repeats", "1", "--no-plots", "--quiet", "-o", str(out), *args])
    return got, out


def test_a_generation_writes_prefill_decode_and_greedy_rows(monkeypatch, tmp_path: Path) -> None:
    got, out = _run(monkeypatch, tmp_path, "-b", "numpy", "-b", "tvm", "--prompt-tokens", "8",
                    "--prompt-tokens", "20", "--new-tokens", "5", "--batch-size", "2")
    assert got.exit_code == 1, got.output[-2000:]  # a cell not ok (tvm's unavailable): exit 1
    rows = pd.read_csv(out)
    assert set(rows.loc[rows.backend == "numpy", "status"]) == {"ok"}
    numpy = rows[rows.backend == "numpy"]
    for length in (8, 20):
        mine = numpy[numpy.prompt_tokens == length]
        assert list(mine.loc[mine.phase == "prefill", "pass"]) == [1, 2, 3]
        decode = mine[mine.phase == "decode"]
        assert len(decode) == 3 * 4 and sorted(set(decode.cache_depth)) == list(range(length, length + 4))
        assert (decode.tokens_per_s == 2 / decode.seconds).all()  # B tokens a step
        (greedy,) = mine.loc[mine.phase == "greedy"].itertuples()
        assert greedy.tokens_matched == 2 * 5 and pd.isna(greedy.mismatch_step)
    tvm = rows[(rows.backend == "tvm") & (rows.phase == "run")]
    assert list(tvm.status) == ["unavailable"] and "no key/value cache path" in tvm.message.iloc[0]
    assert set(rows.loc[rows.backend == "tvm", "phase"]) == {"run"}  # refused before any work


@pytest.mark.parametrize("args, says", [
    (["-b", "numpy", "--prompt-tokens", "120"], "a prompt of 120 tokens and 32 new tokens pass the context of 128"),
    (["-b", "numpy", "--batch-size", "300"], "a generation batch of 300 needs as many prompts"),
    (["-b", "numpy", "--replicas", "2"], "--replicas 2 trains data-parallel replicas and --generate"),
])
def test_bad_generation_input_is_one_line(monkeypatch, tmp_path: Path, args: list[str], says: str) -> None:
    got, out = _run(monkeypatch, tmp_path, *args)
    assert got.exit_code == 2 and says in got.output and "Traceback" not in got.output, got.output
    assert not out.exists()


def test_generate_is_for_decoders_and_its_options_need_it(tmp_path: Path) -> None:
    got = CliRunner().invoke(main, ["run", "mnist", "-b", "numpy", "--generate", "--data", "synthetic"])
    assert got.exit_code == 2 and "--generate needs a decoder language model" in got.output
    got = CliRunner().invoke(main, ["run", "gpt-nano", "-b", "numpy", "--new-tokens", "4"])
    assert got.exit_code == 2 and "add --generate" in got.output
