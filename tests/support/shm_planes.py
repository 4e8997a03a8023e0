"""Reaching into a transfer agent's shared-memory plane, for the shm plane's tests."""

from __future__ import annotations

from kvwire.transfer import TransferAgent
from kvwire.transfer.enums import Backend
from kvwire.transfer.planes.base import PlaneSet
from kvwire.transfer.planes.shm.plane import ShmPlane


def shm_plane(agent: TransferAgent) -> ShmPlane:
    """The shared-memory plane inside an agent's plane set (tests look at its tables)."""
    planes = agent._planes
    assert isinstance(planes, PlaneSet)
    plane = planes.members[Backend.SHM]
    assert isinstance(plane, ShmPlane)
    return plane
