"""The LoadGen scenarios' part of compare's text (``scenarios.rank``'s groups): per context a table of
values, one of verdicts, and the verdict line's part. Imports no other analysis module but the keys,
so that ``tables`` can import it."""
from __future__ import annotations

from typing import Any, Callable, Optional

import pandas as pd

#: (prefix, per-repeat column, what, whether a rate): as ``scenarios.VERDICTS``.
VERDICTS = (("p90", "p90_s", "p90", False), ("p99", "p99_s", "p99", False), ("sps", "sps", "samples/s", True),
            ("peak", "peak_qps", "peak QPS", True))
CONVENTION = ("Scenarios (MLPerf LoadGen): latencies are LoadGen's percentiles (ms), samples/s its rate, peak "
              "QPS the highest Server rate it called valid under --slo-ms; each the median over repeats. A run "
              "below MLPerf's minimum duration or query count is labelled so: never a compliant result.")


def in_context(scenarios: Optional[pd.DataFrame], frame: pd.DataFrame) -> Optional[pd.DataFrame]:
    """The scenario groups of ``frame``'s experiment and device, or None."""
    if scenarios is None or scenarios.empty or frame.empty:
        return None
    experiment, device = frame.index[0][:2]
    sub = scenarios[(scenarios.index.get_level_values("experiment") == experiment)
                    & (scenarios.index.get_level_values("device") == device)]
    return sub if len(sub) else None


def _ms(x: Any) -> str:
    return "n/a" if x is None or pd.isna(x) else f"{x * 1e3:#.4g}"


def _share(x: Any) -> str:
    return "n/a" if x is None or pd.isna(x) else f"{x:.1%}"


def _n(x: Any) -> str:
    return "n/a" if x is None or pd.isna(x) else f"{x:,.0f}"


def blocks(sc: pd.DataFrame, table: Callable[..., str], markdown: bool) -> list[str]:
    """compare's scenario section of one context: its title, the values, the verdicts."""
    scenario = sc["scenario"].iloc[0]
    short = " (below MLPerf's minimum duration or query count: not compliant)" if sc["short"].any() else ""
    title = f"Scenario {scenario} on LoadGen{short}"
    head = ["backend", "status", "repeats", "LoadGen valid", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms",
            "early-stop ms", "samples/s", "peak QPS", "top-1 = ref"]
    rows = [[str(r["label"]), str(r["status"]), str(r["repeats"]), f"{r['valid']}/{r['repeats']}", _ms(r["p50_s"]),
             _ms(r["p90_s"]), _ms(r["p99_s"]), _ms(r["p999_s"]), _ms(r["early_s"]), _n(r["sps"]),
             _n(r["peak_qps"]), _share(r.get("top1"))] for _, r in sc.iterrows()]
    out = [f"**{title}**" if markdown else title, table(head, rows, left={0, 1})]
    if sc["baseline"].ne("").any():
        base = next((b for b in sc["baseline"] if b), "baseline")
        # Offline's latencies are each sample's completion within one query: its figure is samples/s alone
        shown = [v for v in VERDICTS if sc[v[1]].notna().any() and (scenario != "offline" or v[0] == "sps")]
        vhead = ["backend"] + [f"{what} vs {base}" for _, _, what, _ in shown]
        vrows = [[str(r["label"])] + [str(r[f"{p}_text"]) for p, _, _, _ in shown] for _, r in sc.iterrows()]
        out.append(table(vhead, vrows, left=set(range(len(vhead)))))
    return out


def fastest(sc: Optional[pd.DataFrame]) -> list[str]:
    """The verdict line's parts of a context: the best ok group by its scenario's metric."""
    if sc is None:
        return []
    ok = sc[sc["status"] == "ok"]
    scenario = sc["scenario"].iloc[0]
    col, what, low = {"single-stream": ("p90_s", "p90", True), "multi-stream": ("p99_s", "p99", True),
                      "offline": ("sps", "samples/s", False)}.get(
        scenario, ("peak_qps", "peak QPS", False) if sc["peak_qps"].notna().any() else ("p99_s", "p99", True))
    ok = ok[ok[col].notna()]
    if ok.empty:
        return [f"{scenario}: none (no backend passed its checks)"]
    best = ok[col].idxmin() if low else ok[col].idxmax()
    r = ok.loc[best]
    value = _ms(r[col]) + " ms" if col.endswith("_s") else _n(r[col])
    prefix = {"p90_s": "p90", "p99_s": "p99", "sps": "sps", "peak_qps": "peak"}[col]
    how = "" if r[f"{prefix}_verdict"] in ("baseline", "n/a") else f"; vs {r['baseline']}: {r[f'{prefix}_text']}"
    return [f"{scenario} {what}: {r['label']} ({value}{how})"]
