"""Build the data plane a :class:`~kvwire.transfer.config.TransferConfig` names.

Each plane is imported only when chosen, so a CPU process never imports the NCCL modules, and
``planes.base`` imports no plane (the planes import it: dependencies point one way).
"""

from __future__ import annotations

from kvwire.transfer.config import TransferConfig
from kvwire.transfer.enums import Backend
from kvwire.transfer.planes.base import DataPlane


def make_plane(config: TransferConfig, instance_id: str) -> DataPlane:
    """The plane for ``config.backend``, configured from ``config`` alone (nothing read from the
    environment here: the CLI / plugin config built ``config`` at the edge)."""
    if config.backend is Backend.TCP:
        from kvwire.transfer.planes.tcp.plane import TcpPlane

        return TcpPlane(config, instance_id)
    if config.backend is Backend.NCCL:
        from kvwire.transfer.planes.nccl.plane import NcclPlane

        return NcclPlane(config, instance_id)
    raise AssertionError(f"no plane for backend {config.backend!r}")  # Backend is exhaustive here
