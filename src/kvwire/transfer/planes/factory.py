"""Build the data planes a :class:`~kvwire.transfer.config.TransferConfig` asks for.

Each plane is imported only when chosen, so a CPU process never imports the NCCL modules, and
``planes.base`` imports no plane (the planes import it: dependencies point one way).
"""

from __future__ import annotations

from kvwire.supervision import HealthBoard
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.enums import Backend, Transport
from kvwire.transfer.planes.base import DataPlane, PlaneSet


def held_backends(config: TransferConfig) -> list[Backend]:
    """The planes an agent holds, in preference order: the forced one alone, or (``auto``) the
    same-host plane of its device (CUDA IPC on GPUs, shared memory on CPU) next to ``config.backend``
    (the plane for other hosts). Negotiation picks per peer (decision 075)."""
    if config.transport is not Transport.AUTO:
        return [Backend(config.transport.value)]
    if config.device.startswith("cuda"):
        return [Backend.IPC, config.backend]
    return [Backend.SHM, config.backend]


def make_member(
    backend: Backend, config: TransferConfig, instance_id: str, board: HealthBoard | None = None
) -> DataPlane:
    """One plane, configured from ``config`` alone (nothing read from the environment here: the CLI /
    plugin config built ``config`` at the edge); its supervised threads report to ``board``."""
    if backend is Backend.TCP:
        from kvwire.transfer.planes.tcp.plane import TcpPlane

        return TcpPlane(config, instance_id, board)
    if backend is Backend.NCCL:
        from kvwire.transfer.planes.nccl.plane import NcclPlane

        return NcclPlane(config, instance_id, board=board)
    if backend is Backend.SHM:
        from kvwire.transfer.planes.shm.plane import ShmPlane

        return ShmPlane(config, instance_id, board)
    if backend is Backend.IPC:
        from kvwire.transfer.planes.ipc.plane import IpcPlane

        return IpcPlane(config, instance_id, board)
    raise AssertionError(f"no plane for backend {backend!r}")  # Backend is exhaustive here


def make_plane(config: TransferConfig, instance_id: str, board: HealthBoard | None = None) -> PlaneSet:
    """The agent's plane set: every held plane behind one :class:`DataPlane`, routed per peer. Every
    plane's supervised threads (acceptors, the fail loop, reporters, completers, the NCCL janitor)
    report to ``board``, the process's (a private one when None: restarts are logged, nobody's
    ``/health`` reads them)."""
    board = board if board is not None else HealthBoard()
    members = [(b, make_member(b, config, instance_id, board)) for b in held_backends(config)]
    return PlaneSet(members, instance_id, config.device, config.transport, board)
