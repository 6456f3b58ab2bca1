"""Typed errors raised by the library. Only ``cli.py`` maps them to exit codes."""
from __future__ import annotations


class BenchError(Exception):
    """Base class of every error the library raises on purpose."""


class WorkloadError(BenchError):
    """A workload YAML is missing, malformed or invalid (usage error, exit 2)."""


class DataError(BenchError):
    """A data set is missing, corrupt or cannot be fetched."""


class BackendUnavailable(BenchError):
    """A backend (or the device asked of it) is not installed or not present here."""


class ResultsError(BenchError):
    """A results CSV is missing, truncated or has the wrong schema."""


class EnvError(BenchError):
    """An isolated backend environment could not be built or is broken."""


class ClusterError(BenchError):
    """Cluster options without ``--executor ray``, or a Ray cluster that cannot be reached or joined
    (usage error, exit 2)."""


class OutputError(BenchError):
    """A results file or plots folder cannot be written where asked (usage error, exit 2)."""
