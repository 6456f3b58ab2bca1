"""The ``loadgen`` section of a workload: MLPerf's inference scenarios, run by MLPerf's LoadGen
(``--scenario``; docs/scenarios.md).

A scenario asks a deployment question of the inference path: SingleStream (one sample per query,
the next issued when the last completes: its p90 latency), MultiStream (``multistream_samples``
per query, back to back: its p99), Server (one-sample queries arriving as a Poisson process at
``server_target_qps``: is the p99 under ``server_latency_ms``?) and Offline (every sample in one
query: samples/s). The scenario is a dimension of the matrix: ``--scenario`` makes one copy of the
workload per scenario (``with_scenario``), so each is its own experiment with its own hash.

MLPerf's own minimums (600 s and a scenario's query count) are far too long for a CPU smoke run,
so the defaults here are short; a run below MLPerf's minimums says so in every row
(``below_mlperf_minimum``) and is never presented as compliant.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from .layers import Strict

SCENARIOS = ("single-stream", "multi-stream", "server", "offline")
Scenario = Literal["single-stream", "multi-stream", "server", "offline"]
#: MLPerf Inference's minimum duration of a performance run, every scenario (seconds).
MLPERF_MIN_DURATION_S = 600.0
#: MLPerf Inference's minimum query count per scenario (datacenter and edge rules, v4+): Offline is
#: one query (of at least 24,576 samples).
MLPERF_MIN_QUERIES = {"single-stream": 1024, "multi-stream": 270_336, "server": 270_336, "offline": 1}
#: The fewest queries LoadGen's early stopping accepts (every query under the bound) at the
#: scenario's percentile: p90 (SingleStream) 64, p99 (MultiStream, Server) 662 (its summary says so).
EARLY_STOPPING_QUERIES = {"single-stream": 64, "multi-stream": 662, "server": 662, "offline": 1}
#: OpenVINO's performance hint per scenario: latency where queries come one at a time, throughput
#: where many are in flight (``Options.performance_hint``; the row records it).
HINTS = {"single-stream": "LATENCY", "multi-stream": "LATENCY", "server": "THROUGHPUT", "offline": "THROUGHPUT"}


class LoadgenSpec(Strict):
    """``--scenario``'s settings; every field has a command-line override (docs/scenarios.md)."""

    scenario: Optional[Scenario] = Field(
        default=None, description="the scenario this copy of the workload runs (`--scenario`, repeatable: one "
                                  "copy per scenario); unset: the fixed-batch inference passes")
    min_duration_s: float = Field(default=2.0, gt=0.0,
                                  description="LoadGen's minimum duration of the timed run (`--min-duration`); "
                                              "MLPerf's is 600 s: a shorter run is labelled below MLPerf's minimum")
    min_query_count: Optional[int] = Field(
        default=None, gt=0, description="LoadGen's minimum query count (`--min-queries`); unset: the fewest its early "
                                        "stopping accepts with no query over: 64 (SingleStream's p90), 662 "
                                        "(MultiStream's and Server's p99), 1 (Offline). MLPerf's: 1,024, 270,336, "
                                        "270,336, 1")
    server_target_qps: Optional[float] = Field(
        default=None, gt=0.0, description="Server: the offered rate of the Poisson arrivals (`--target-qps`); unset: "
                                          "half the rate one sample at a time sustains, measured untimed first")
    server_latency_ms: float = Field(default=100.0, gt=0.0,
                                     description="Server: the p99 latency bound LoadGen judges the run by "
                                                 "(`--latency-bound-ms`; `--slo-ms` sets it too)")
    multistream_samples: int = Field(default=8, gt=0,
                                     description="MultiStream: samples per query (`--multistream-samples`)")
    slo_ms: Optional[float] = Field(
        default=None, gt=0.0, description="Server: search the highest target QPS whose p99 stays under this bound "
                                          "(`--slo-ms`), each probe a LoadGen run; unset: one run at the target")
    search_precision: float = Field(default=0.02, gt=0.0, lt=1.0,
                                    description="the peak search stops when its bracket is within this share")

    def queries(self, scenario: str) -> int:
        """The minimum query count of ``scenario``: ``min_query_count``, else early stopping's fewest."""
        return self.min_query_count or EARLY_STOPPING_QUERIES[scenario]

    @property
    def below_mlperf_minimum(self) -> bool:
        """Whether a run with these settings is shorter than MLPerf's minimum duration or query count."""
        s = self.scenario or "single-stream"
        return self.min_duration_s < MLPERF_MIN_DURATION_S or self.queries(s) < MLPERF_MIN_QUERIES[s]


def with_scenario(workload: Any, scenario: Scenario, **overrides: Any) -> Any:
    """A copy of ``workload`` that runs ``scenario``: its ``loadgen`` settings (the YAML's, else the
    defaults) with the command line's ``overrides`` (fields of :class:`LoadgenSpec`; None: not
    given), which the workload hash then covers. Raises ``WorkloadError`` for a language model and
    for ``slo_ms`` outside the Server scenario."""
    from ..errors import WorkloadError

    if workload.next_token:
        raise WorkloadError(f"{workload.name}: --scenario times classifiers (one output per sample); a language "
                            f"model's inference is --generate")
    given = {k: v for k, v in overrides.items() if v is not None}
    if given.get("slo_ms") is not None and scenario != "server":
        given.pop("slo_ms")  # --slo-ms searches the Server scenario's peak; the others run as they are
    base = (workload.loadgen or LoadgenSpec()).model_dump()
    if scenario != "server":
        base["slo_ms"] = None
    spec = LoadgenSpec.model_validate({**base, **given, "scenario": scenario})
    return workload.model_copy(update={"loadgen": spec})
