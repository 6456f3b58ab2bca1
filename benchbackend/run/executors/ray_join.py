"""Joining a Ray cluster, or starting a local one, for the Ray executor (``RayExecutor.connect``).

An ``--address`` is checked first (a closed port is one line at once; ``ray.init`` would retry for
minutes). A port that answers is a head that is up, so the driver asks its GCS ``JOIN_TRIES``
times, a second apart, not Ray's 20 (``RAY_gcs_server_port_wait_time_s``; the user's own value
wins): a refused join said why after 20 s. While a named cluster is joined, what Ray's core writes
to stderr is kept off the terminal: a refused join logs a line a second until ``ray.init`` raises,
and the user reads one line that says why; a join that succeeds writes it out as it was. A
cluster that asks for a token this driver did not send says what to set (``RAY_AUTH_MODE=token``).
A local cluster gives its worker processes niceness 0, not Ray's 15 (``ray_node.normal_priority``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import tempfile
from typing import Iterator, Optional

import ray

from ...errors import ClusterError
from .ray_node import local_resources

_CONNECT_TIMEOUT_S = 10.0
#: Ray's own budget for a driver's connection to the GCS, in tries a second apart (its default: 20).
_GCS_TRIES = "RAY_gcs_server_port_wait_time_s"
JOIN_TRIES = 5


def join(address: Optional[str], num_cpus: Optional[int]) -> bool:
    """Join ``address``, or start a local cluster of ``num_cpus`` (None: all cores), unless this
    process is already connected; whether this call connected it. Raises ``ClusterError`` when
    the address cannot be reached or Ray fails to start."""
    if address:
        _check_reachable(address)
    if ray.is_initialized():
        return False
    quiet = {"logging_level": logging.ERROR, "log_to_driver": False, "include_dashboard": False}
    failure: Optional[Exception] = None
    # Not while starting a local cluster: Ray's processes would inherit the spool as their stderr.
    with _stderr_kept(keep=bool(address)) as logged:
        try:
            if address:
                with _default_env(_GCS_TRIES, str(JOIN_TRIES)):
                    ray.init(address=address, **quiet)
            else:
                # "local": a new cluster, even where another runs on this machine (ray.init() would
                # join the last one started here, e.g. by `ray start` or a test's cluster).
                ray.init(address="local", num_cpus=num_cpus, resources=local_resources(),
                         _system_config={"worker_niceness": 0}, **quiet)
        except (ConnectionError, RuntimeError, ValueError, TimeoutError) as exc:
            failure = exc
    if failure is not None:
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        raise ClusterError(f"cannot join {where}: {str(failure).strip().splitlines()[0]}{_token_hint(logged.text)}")
    sys.stderr.write(logged.text)  # what Ray's core said while joining, as it would have
    return True


@contextlib.contextmanager
def _default_env(name: str, value: str) -> Iterator[None]:
    """``name`` set to ``value`` meanwhile, unless the environment already sets it."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


class _Kept:
    """What was written to stderr while it was kept (after the block)."""

    text = ""


@contextlib.contextmanager
def _stderr_kept(keep: bool) -> Iterator[_Kept]:
    """Keep what is written to this process's stderr descriptor (Ray's core writes there) meanwhile,
    where ``keep``; its text is the yielded object's after the block."""
    kept = _Kept()
    if not keep:
        yield kept
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as spool:
        os.dup2(spool.fileno(), 2)
        try:
            yield kept
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            spool.seek(0)
            kept.text = spool.read().decode(errors="replace")


def _token_hint(logged: str) -> str:
    """Why a join was refused, where Ray's core logged that the cluster refused this driver's token
    (``ray.init`` itself says no more than "Failed to connect"). A cluster that ``ray start`` started
    asks for one where the head has a token (any local ``ray.init`` makes one, in ~/.ray), and Ray
    sends its token to an address named explicitly only in ``RAY_AUTH_MODE=token``: Ray's choice,
    kept (a token goes only where the user says)."""
    if "InvalidAuthToken" not in logged:
        return ""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return ("; the cluster asks for its token (Ray's token authentication): set RAY_AUTH_MODE=token, with "
                "the head's token (`ray get-auth-token` there) in ~/.ray/auth_token or RAY_AUTH_TOKEN")
    return ("; the cluster refused this machine's token: use the head's (`ray get-auth-token` there), in "
            "~/.ray/auth_token or RAY_AUTH_TOKEN")


def _check_reachable(address: str) -> None:
    if address == "auto" or "://" in address:
        return  # ray.init resolves these itself
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"--address {address}: expected HOST:PORT (the head node's GCS port, 6379 by default)")
    try:
        socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ClusterError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc} "
                           f"(is `ray start --head` running there?)") from None
