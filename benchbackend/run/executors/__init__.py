"""Executors run a plan's groups of cells: ``local`` (this machine, one cell at a time) and ``ray``."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ...errors import ClusterError

if TYPE_CHECKING:
    from ..runner import Executor


def make(name: str, address: Optional[str] = None, cells_per_node: Optional[int] = None,
         allow_mixed_hosts: bool = False, timeout: Optional[float] = None,
         preload: bool = True, wait_for_nodes: float = 0.0, retries: int = 0) -> "Executor":
    """The executor ``--executor`` names; a Ray cluster is joined (or started) here, before data is
    prepared. Raises ``ClusterError`` for cluster options without Ray, Ray not installed, or a
    cluster that cannot be joined."""
    if name == "local":
        given = [f for f, v in (("--address", address), ("--cells-per-node", cells_per_node),
                                ("--allow-mixed-hosts", allow_mixed_hosts), ("--wait-for-nodes", wait_for_nodes),
                                ("--retries", retries)) if v]
        if given:
            raise ClusterError(f"{', '.join(given)} needs --executor ray")
        from .local import LocalExecutor

        return LocalExecutor(timeout, preload)
    try:
        from .ray import RayExecutor
    except ImportError as exc:
        raise ClusterError(f"--executor ray needs Ray ({exc}): pip install 'benchbackend[ray]'") from None
    executor = RayExecutor(address=address, cells_per_node=cells_per_node, allow_mixed_hosts=allow_mixed_hosts,
                           timeout=timeout, wait_for_nodes=wait_for_nodes, retries=retries, preload=preload)
    executor.connect()
    return executor
