"""When other processes held the machine: the rule that reads a repeat's ``foreign_cpu_share`` rows.

The worker measures (``run.machine``); this module decides, for the run's own note and for
``compare`` alike: a repeat is *busy* over a verdict phase (its training epochs, its inference
passes, its generation passes) when other processes held more than ``BUSY_SHARE`` of its cores there, weighted by the
rows' seconds (README "Trust"). ``compare`` withholds the verdicts such a repeat would feed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping

if TYPE_CHECKING:  # the worker reads BUSY_SHARE in environments without pandas (Chainer's, PlaidML's)
    import pandas as pd

#: The verdict of a group whose (or whose baseline's) timed repeats other processes made busy (``compare.BUSY``).
WITHHELD = "no verdict (machine busy)"
#: A repeat is busy when other processes held more than this share of its cores over a verdict phase
#: (``phase_shares``). Measured with ``benchmarks/aa.py`` on this 2-core machine (README "Trust"):
#: 120 quiet torch repeats read 1.2% (median) to 3.2% (max); beside two spinning processes every
#: repeat read 50%, and torch's steady epoch took 113x as long (0.038 s to 4.28 s). 10% is three
#: times the quiet maximum and a fifth of one hog's share.
BUSY_SHARE = 0.10
#: The rows whose timings feed a verdict (``compare``): training epochs and inference passes.
VERDICT_PHASES = ("train_epoch", "inference")
#: ``--generate``'s timed rows: one verdict phase, ``generation`` (a pass's prefill and its decode steps).
GENERATION_PHASES = ("prefill", "decode")
GENERATION = "generation"
#: Every row the worker times (and so watches the machine around).
TIMED_PHASES = ("build", "tune", *VERDICT_PHASES, *GENERATION_PHASES)
#: The shortest timed window whose share is read on its own. The kernel counts idle time in ticks
#: (10 ms a core), so a window of W seconds on C cores reads others' share to about C ticks / (W x C):
#: one 6 ms inference pass of a small network reads 0% or 70% on a quiet machine, half a second
#: reads within 2-4%.
MIN_WINDOW = 0.5


def phase_shares(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """The share of a cell's cores other processes held over each verdict phase of one repeat: the
    mean of its rows' ``foreign_cpu_share`` weighted by their seconds. A phase timed for less than
    ``MIN_WINDOW`` in all is read over every timed region of the repeat instead (its build, tune,
    epochs and passes: the machine around it); where even that is shorter, it is not judged. The
    run's note and ``compare`` (``summary``) both read a repeat through this function."""
    sums: dict[str, list[float]] = {}
    for row in rows:
        share, seconds = row.get("foreign_cpu_share"), row.get("seconds")
        if row.get("phase") in TIMED_PHASES and share is not None and share == share and seconds and seconds > 0:
            phase = GENERATION if row["phase"] in GENERATION_PHASES else row["phase"]
            for key in (phase, ""):
                acc = sums.setdefault(key, [0.0, 0.0])
                acc[0] += share * seconds
                acc[1] += seconds
    cell = sums.get("", [0.0, 0.0])
    out = {}
    for phase in (*VERDICT_PHASES, GENERATION):
        if phase in sums:
            held, seconds = sums[phase] if sums[phase][1] >= MIN_WINDOW else cell
            if seconds >= MIN_WINDOW:
                out[phase] = held / seconds
    return out


def busy_note(rows: Iterable[Mapping[str, Any]]) -> str:
    """What a cell's ``run`` row notes when other processes held more than ``BUSY_SHARE`` of its
    cores during its training or its inference ("" otherwise): ``compare`` withholds the verdicts
    that phase would feed."""
    busy = {p: v for p, v in phase_shares(rows).items() if v > BUSY_SHARE}
    if not busy:
        return ""
    names = {"train_epoch": "its training epochs", "inference": "its inference passes",
             GENERATION: "its generation passes"}
    first, *rest = [f"{v:.0%} during {names[p]}" for p, v in busy.items()]
    first = first.replace(" during ", " of this cell's cores during ", 1)
    return (f"machine busy: other processes held {' and '.join([first, *rest])} (over {BUSY_SHARE:.0%}); "
            "compare gives no verdict on these timings")


def repeat_shares(df: "pd.DataFrame") -> "pd.DataFrame":
    """Per ``_repeat`` (``summary.per_repeat``'s numbering): the share of its cores other processes
    held over its training epochs (``train_busy``), its inference passes (``infer_busy``) and its
    generation passes (``gen_busy``), read
    by :func:`phase_shares`, the rule the run's own note follows (NaN: not measured, or too short)."""
    import pandas as pd

    def numbers(name: str) -> pd.Series:
        return pd.to_numeric(df[name], errors="coerce") if name in df else pd.Series(float("nan"), index=df.index)

    rows = pd.DataFrame({"_repeat": df["_repeat"], "phase": df["phase"], "seconds": numbers("seconds"),
                         "foreign_cpu_share": numbers("foreign_cpu_share")})
    rows = rows[rows["phase"].isin(TIMED_PHASES) & rows["foreign_cpu_share"].notna()]
    shares = {rep: phase_shares(part.to_dict("records")) for rep, part in rows.groupby("_repeat", sort=False)}
    frame = pd.DataFrame.from_dict(shares, orient="index", columns=[*VERDICT_PHASES, GENERATION], dtype=float)
    return frame.rename(columns={"train_epoch": "train_busy", "inference": "infer_busy", GENERATION: "gen_busy"})


def is_busy(reps: "pd.DataFrame", phase: str = "") -> "pd.Series":
    """Whether other processes held more than ``BUSY_SHARE`` of each repeat's cores over
    ``phase`` (``train``, ``infer`` or ``gen``; any, when empty). Not measured is not busy."""
    cols = [f"{phase}_busy"] if phase else [c for c in ("train_busy", "infer_busy", "gen_busy") if c in reps]
    return (reps[cols] > BUSY_SHARE).any(axis=1)
