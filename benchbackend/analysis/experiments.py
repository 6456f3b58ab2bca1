"""Which rows may be compared: experiments (one definition of a workload) and the group keys within them.

A *definition* is (workload, workload_hash, data_source); the hash covers the model, training
settings, sizes after ``--limit``, epochs, batch size and seed. Rows of different definitions are
never pooled. When one workload name has several definitions in the files read, each is labelled
by the fields that differ (``mnist (limit 1024)``, ``mnist (batch 128)``), read from the
definition columns (``results.DEFINITION_COLUMNS``), or by its hash when no field tells them apart.

A *group* (:class:`GroupKey`) is one (experiment, device, backend, mode, precision): the unit that
``compare`` ranks and the figures draw.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable

import pandas as pd

#: The columns that name a group, in the order of :class:`GroupKey`'s fields.
GROUP_KEYS = ["experiment", "device", "backend", "mode", "precision"]
#: The columns that name one comparison (a section of compare's output, a set of figures).
CONTEXT_KEYS = ["experiment", "device"]
#: A repeat is one fresh worker process.
REPEAT_KEYS = ["run_id", "repeat"]
#: How each definition column is named in an experiment's label.
#: A group's mode for N replicas (:func:`group_mode`), read back by :func:`split_mode`.
_REPLICA_MODE = re.compile(r"^(?P<mode>.*) x(?P<n>\d+)(?P<weak> weak)?$")
LABEL_NAMES = {"limit": "limit", "epochs": "epochs", "batch_size": "batch", "inference_batch_size": "infer_batch",
                "seed": "seed", "data_source": "data", "threads": "threads"}
#: What names one definition: the workload's hash, its data, and the threads its cells ran on.
DEFINITION_KEYS = ["workload", "workload_hash", "data_source", "threads"]


@dataclass(frozen=True)
class GroupKey:
    """One group of results: an experiment on a device, one backend, mode and precision."""

    experiment: str
    device: str
    backend: str
    mode: str
    precision: str

    @classmethod
    def of(cls, values: Iterable[Any]) -> "GroupKey":
        """From a row of the ``GROUP_KEYS`` columns (a frame's index entry)."""
        return cls(*(str(v) for v in values))

    @property
    def index(self) -> tuple[str, str, str, str, str]:
        """The key as a frame's index entry (``GROUP_KEYS`` order)."""
        return self.experiment, self.device, self.backend, self.mode, self.precision

    @property
    def context(self) -> tuple[str, str]:
        return self.experiment, self.device

    def label(self, show_mode: bool = True) -> str:
        """``torch``, ``torch:compile``, ``torch@bf16``, ``torch:compile@bf16``."""
        name = self.backend + (f":{self.mode}" if show_mode and self.mode else "")
        return name + (f"@{self.precision}" if self.precision not in ("", "fp32") else "")

    def __str__(self) -> str:
        """``mnist/cpu/torch:eager@bf16``: how warnings name a group."""
        return f"{self.experiment}/{self.device}/{self.label()}"

    def matches(self, name: str) -> bool:
        """Whether ``BACKEND`` or ``BACKEND:MODE`` (as a user writes it) names this group."""
        backend, sep, mode = name.partition(":")
        return self.backend == backend and (not sep or self.mode == mode)


def context_name(context: tuple[str, str]) -> str:
    """``mnist (limit 1024) on cpu``: how sections, figures and warnings name a comparison."""
    return f"{context[0]} on {context[1]}"


def labels(keys: Iterable[GroupKey]) -> dict[GroupKey, str]:
    """How each group is named: the mode only for a backend seen in several modes (``torch``
    rather than ``torch:eager`` when eager is all there is)."""
    keys = list(keys)
    modes: dict[str, set[str]] = {}
    for k in keys:
        modes.setdefault(k.backend, set()).add(k.mode)
    return {k: k.label(show_mode=len(modes[k.backend]) > 1) for k in keys}


def for_comparison(df: pd.DataFrame) -> pd.DataFrame:
    """A copy shaped for comparing backends: ``experiment`` names one definition (rows are pooled
    and compared only within one); ``precision`` is ``fp32`` where older files left it empty;
    ``device`` is what the user asked for (``--device cpu``) where recorded, since backends name
    one device differently (torch ``cpu``, TensorFlow ``cpu:0``, PlaidML ``llvm_cpu.0``); ``mode``
    is the backend's default mode where a file left it empty, so that ``--baseline torch:eager``
    names it and every output carries a mode; a cell of N > 1 data-parallel replicas has mode
    ``eager xN`` (``eager xN weak`` under weak scaling), a group of its own beside the single
    replica's (its speed-up against it is N times the scaling efficiency: ``scaling.py``). The rows
    of an attempt lost with its node and run again (``retried``) are left out: the attempt that
    followed measured the cell, and so are the stale ``unavailable`` rows of a group that a later
    run measured (:func:`_without_stale_unavailable`)."""
    from ..backends import registry
    from ..results import RETRIED

    out = df[df["status"] != RETRIED].copy()
    out["experiment"] = experiments(out)
    out["precision"] = out["precision"].astype(str).replace("", "fp32")
    mode = out["mode"].astype(str)
    if (mode == "").any():
        defaults = {name: spec.default_mode for name, spec in registry.BACKENDS.items()}
        out["mode"] = mode.where(mode != "", out["backend"].map(defaults).fillna(""))
    asked = out["requested_device"].astype(str)
    out["device"] = asked.where(asked != "", out["device"])
    if "compile_cache" in out.columns:  # --compile-cache cold is its own group: ``compile cold`` beside ``compile``
        out["mode"] = out["mode"].where(out["compile_cache"].astype(str) != "cold", out["mode"] + " cold")
    if "replicas" in out.columns:  # N replicas are their own group: ``eager x2`` beside ``eager``
        many = pd.to_numeric(out["replicas"], errors="coerce").fillna(1).astype(int)
        scaling = out["scaling"] if "scaling" in out.columns else pd.Series("strong", index=out.index)
        out["mode"] = group_mode(out["mode"], many, scaling)
    return _without_stale_unavailable(out)


def _without_stale_unavailable(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` without the ``unavailable`` cells of a group that another run measured at or after
    them: an unavailable cell measured nothing, and what it lacked (the backend, a mode, a device)
    has been there since, so its row would only pool "1 ok + 1 unavailable" into a group that is
    then not ranked. An ``unavailable`` row later than every other run of its group stays (that is
    news), and so does one of the run that measured the group's other repeats."""
    gone = df["status"] == "unavailable"
    if not gone.any() or gone.all():
        return df
    stamp = df["timestamp"].astype(str) if "timestamp" in df.columns else pd.Series("", index=df.index)
    keys = GROUP_KEYS + ["run_id"]
    measured = stamp[~gone].groupby([df.loc[~gone, k] for k in keys]).max()
    runs: dict[tuple, list[tuple[str, str]]] = {}
    for (*group, run), last in measured.items():
        runs.setdefault(tuple(group), []).append((run, last))
    stale = gone.to_numpy().copy()  # by position: the rows of several files may share index labels
    for pos in stale.nonzero()[0]:
        row, when = df.iloc[pos], stamp.iloc[pos]
        stale[pos] = any(run != row["run_id"] and last >= when for run, last in runs.get(tuple(row[GROUP_KEYS]), []))
    return df[~stale]


def with_experiment(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` shaped by :func:`for_comparison` unless it already is (plots may be given a frame
    straight from ``results.read``)."""
    return df if "experiment" in df.columns else for_comparison(df)


def _fill_definition(frame: pd.DataFrame, run: list[pd.Series]) -> pd.DataFrame:
    """A status row written before anything was known (a worker that died at once, an unavailable
    backend: no threads) joins the definition of its run in its file, or the workload's only one."""
    for col in ("workload_hash", "data_source", "threads"):
        for by in (run, [frame["workload"]]):
            missing = frame[col] == ""
            if not missing.any():
                break
            known = frame[col].where(~missing)
            single = known.groupby(by).transform(lambda s: s.dropna().iloc[0] if s.dropna().nunique() == 1 else "")
            frame[col] = frame[col].where(~missing, single.astype(object).fillna(""))
    return frame


def text(value: Any) -> str:
    """A definition value as a label shows it: ``1024``, not ``1024.0``; "" when not recorded."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def _fields(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The readable fields of each definition: its definition columns, else (files before the
    definition was recorded) the sizes its rows show."""
    cols = [c for c in LABEL_NAMES if c not in keys]
    recorded = df[keys + cols].copy()
    recorded[cols] = recorded[cols].map(text)
    fields = recorded[recorded[cols].ne("").any(axis=1)].groupby(keys, sort=False)[cols].first()
    train = df[df["phase"] == "train_epoch"].groupby(keys, sort=False)
    derived = pd.DataFrame({"limit": train["samples"].max(), "epochs": train["epoch"].max()}).map(text)
    return fields.combine_first(derived).fillna("") if len(fields) else derived


def _distinct(workload: str, fields: dict[tuple, dict[str, str]]) -> dict[tuple, str]:
    """Labels of one workload's several definitions: the fields that differ, else the hash."""
    recorded = [{k for k, v in got.items() if v} for key, got in fields.items() if key[1]]
    names = sorted(set.intersection(*recorded)) if recorded else []
    differ = [f for f in names if len({got.get(f) for got in fields.values()}) > 1]
    # --batch-size sets both batch sizes: the inference batch is named only when it differs on its own
    if "batch_size" in differ and all(got.get("inference_batch_size") == got.get("batch_size")
                                      for got in fields.values()):
        differ = [f for f in differ if f != "inference_batch_size"]
    out = {}
    for key, got in fields.items():
        parts = [f"{LABEL_NAMES[f]} {got[f]}" for f in differ if got.get(f)]
        out[key] = (f"{workload} ({', '.join(parts)})" if parts and key[1] else
                    workload if key[1] else f"{workload} (def unknown)")
    taken = pd.Series(list(out.values())).value_counts()
    for key in fields:  # readable fields do not tell these apart: the hash does
        if taken[out[key]] > 1:
            tag = f"def {key[1][:6] or 'unknown'}"
            out[key] = f"{out[key][:-1]}, {tag})" if out[key] != workload else f"{workload} ({tag})"
    return out


def experiments(df: pd.DataFrame) -> pd.Series:
    """Each row's experiment label: the workload name, qualified by what differs when the rows hold
    several definitions of one workload name, e.g. ``mnist (limit 1024)`` and ``mnist (limit 2000)``
    (see the module docstring). Rows of a status with no hash or data source (old files) join the
    workload's only definition when it has one."""
    keys = DEFINITION_KEYS
    frame = pd.DataFrame({k: df[k].astype(str) for k in keys[:3]}, index=df.index)
    frame["threads"] = cell_threads(df)
    run = [frame["workload"]] + [df[c].astype(str) for c in ("source", "run_id") if c in df.columns]
    frame = _fill_definition(frame, run)
    defs = frame.drop_duplicates()
    counts = defs.groupby("workload")["workload_hash"].transform("size")
    names = pd.Series(defs["workload"].to_numpy(), index=pd.MultiIndex.from_frame(defs))
    multi = defs[counts.to_numpy() > 1]
    if len(multi):
        fields = _fields(df.assign(**{k: frame[k] for k in keys}), keys)
        for workload, sub in multi.groupby("workload", sort=False):
            found = {key: {**(fields.loc[key].to_dict() if key in fields.index else {}), "data_source": key[2],
                           "threads": key[3]} for key in sub.itertuples(index=False, name=None)}
            for key, name in _distinct(workload, found).items():
                names[key] = name
    index = pd.MultiIndex.from_frame(frame)
    return pd.Series(names.reindex(index).to_numpy(), index=df.index, name="experiment")


def cell_threads(df: pd.DataFrame) -> pd.Series:
    """Each row's cell's threads as text (``4``; "" where not recorded): the ``threads`` column is
    each replica's, so a cell of N replicas ran on N times it (which its single replica is compared
    with: ``scaling``). Threads define an experiment, as the batch size does: ``compare`` never
    pools rows of two counts, which time different machines in effect."""
    threads = pd.to_numeric(df["threads"], errors="coerce") if "threads" in df else pd.Series(float("nan"),
                                                                                               index=df.index)
    if "replicas" in df:
        threads = threads * pd.to_numeric(df["replicas"], errors="coerce").fillna(1)
    return threads.map(lambda v: "" if pd.isna(v) else f"{v:g}")


def group_mode(mode: pd.Series, replicas: pd.Series, scaling: pd.Series) -> pd.Series:
    """The mode a group of ``replicas`` is compared under: ``eager``, ``eager x2``, ``eager x2 weak``."""
    many = replicas > 1
    suffix = " x" + replicas.astype(str) + scaling.astype(str).eq("weak").map({True: " weak", False: ""})
    return mode.where(~many, mode + suffix)


def split_mode(mode: str) -> tuple[str, int, str]:
    """(the single replica's mode, replicas, scaling) of a group's mode (:func:`group_mode`)."""
    m = _REPLICA_MODE.match(mode)
    if not m:
        return mode, 1, "strong"
    return m["mode"], int(m["n"]), "weak" if m["weak"] else "strong"
