"""D's receive outcomes held back while a sender may still write into the blocks (decision 114).

A receive that failed or was aborted normally gives its blocks back at once: the engine recomputes
into them, fails the request, or frees them. On the shared-memory plane's one-copy path the *sender*
writes into D's blocks, and a sender stalled in the middle of a layer for longer than the revoke
wait may still finish that copy later; the transfer agent then reports the transfer ``unsettled``
(:meth:`kvwire.transfer.TransferAgent.unsettled`). Its outcome is kept here instead of going to the
engine, so the engine keeps the blocks (the request waits for its remote KV, or an aborted one keeps
its blocks until ``finished_sending``), and reported in the first step after the agent lets the
transfer go (the sender let go of its grant, or its process ended). Worker thread only.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Generic, Protocol, TypeVar

from prometheus_client import Gauge

logger = logging.getLogger(__name__)

Out = TypeVar("Out")


class _Agent(Protocol):
    def unsettled(self) -> Mapping[str, int]: ...


@dataclasses.dataclass
class _Held(Generic[Out]):
    request_id: str
    transfers: frozenset[str]  # the request's transfers the agent reported unsettled
    num_blocks: int
    report: Callable[[Out], None]  # what the step output gets once they are all settled
    since: float = dataclasses.field(default_factory=time.monotonic)


class ReceiveQuarantine(Generic[Out]):
    """Outcomes of failed/aborted receives held back per request; ``gauge``: blocks held."""

    def __init__(self, agent: _Agent, gauge: Gauge) -> None:
        self._agent = agent
        self._gauge = gauge
        self.held: list[_Held[Out]] = []  # read by the worker: no call while nothing is held

    def report_when_settled(
        self, request_id: str, num_blocks: int, transfers: Collection[str], report: Callable[[Out], None],
        out: Out,
    ) -> None:
        """``report(out)`` now when none of ``transfers`` is unsettled; otherwise hold it (the engine
        keeps the request's ``num_blocks`` blocks) until they all are settled."""
        unsettled = self._agent.unsettled()
        held = frozenset(t for t in transfers if t in unsettled) if unsettled else frozenset()
        if not held:
            report(out)
            return
        self.held.append(_Held(request_id, held, num_blocks, report))
        self._gauge.inc(num_blocks)
        logger.warning(
            "request %s: %d KV block(s) quarantined: a stalled sender may still write into them "
            "(transfer %s); they go back to the engine once it lets go or exits",
            request_id, num_blocks, ", ".join(sorted(held)),
        )  # fmt: skip

    def release_settled(self, out: Out) -> None:
        """Report the held outcomes whose transfers are all settled now (one agent call per step,
        only while something is held)."""
        if not self.held:
            return
        unsettled = self._agent.unsettled()
        still: list[_Held[Out]] = []
        for held in self.held:
            if not held.transfers.isdisjoint(unsettled):
                still.append(held)
                continue
            held.report(out)
            self._gauge.dec(held.num_blocks)
            logger.info(
                "request %s: %d quarantined KV block(s) released after %.3f s",
                held.request_id, held.num_blocks, time.monotonic() - held.since,
            )  # fmt: skip
        self.held = still

    @property
    def num_blocks(self) -> int:
        return sum(held.num_blocks for held in self.held)

    def close(self) -> None:
        """The engine ends: nothing reuses the blocks any more."""
        for held in self.held:
            self._gauge.dec(held.num_blocks)
        self.held = []
