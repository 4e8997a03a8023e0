"""One direction of NCCL traffic with one peer epoch: its communicators (lanes), CUDA streams, two threads.

A :class:`SendChannel` (rank 0) and the peer's :class:`RecvChannel` (rank 1) share two-rank
communicators used in one direction only: a posted receive waiting for data therefore never delays a
send in the other direction (NCCL runs the operations of one communicator in issue order).

**Lanes.** A channel holds ``NcclPlaneConfig.lanes`` communicators (the receiver's offer names them),
each driven on a CUDA stream of its own; the receiver's chunk plan says which lane carries each
message, and a transfer's messages take turns. NCCL runs one communicator's kernels one after the
other, and each message pays ~14 us of start-up (launch, rendezvous, first steps) before its bytes
flow; on another lane the next message's start-up overlaps the current message's data (decision 067).
Each lane keeps ``seq`` order on both ends, which is all NCCL asks.

Threads per channel:

* the **issuer** joins the communicator (non-blocking init, deadline), then launches work as it
  becomes possible: one ``ncclGroupStart/End`` per batch of chunks, all on the channel's stream;
  it also runs the watchdog (an operation in flight longer than ``stall_timeout_s`` aborts the
  communicator and fails the peer) and closes the channel when idle;
* the **completer** waits for each batch's CUDA event in issue order (``Event.synchronize`` releases
  the GIL; ``ncclCommAbort`` ends a stuck wait) and reports ``on_sent`` / ``on_received`` with the
  channel's delivery stream as the current stream (ordered after the receive where a host sink may
  enqueue work), one callback per run of one transfer's completed chunks.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from kvwire.errors import TransferError
from kvwire.transfer.memory import GATE_MAGIC, RecvItem, SendItem
from kvwire.transfer.planes.base import PlaneCallbacks
from kvwire.transfer.planes.nccl.bindings import NcclComm, abort_all
from kvwire.transfer.planes.nccl.config import NcclPlaneConfig
from kvwire.transfer.planes.nccl.memory import NcclBuffer, ZeroCopyMemory
from kvwire.transfer.planes.nccl.plane_info import ChunkPlan, CommOffer

log = logging.getLogger("kvwire.transfer.planes.nccl.plane")

MiB = 1 << 20
STATUS_MAGIC = GATE_MAGIC  # every chunk is followed by an 8-byte status message [magic, real]
_WAIT_PERIOD_S = 0.05
_MAX_CANCELLED = 65536
_MAX_DEFERRED = 64  # completed chunks whose reports wait for a following one (see _Channel._coalesce)


class CancelledSet:
    """Transfer ids the agent gave up (bounded, thread-safe), shared by every channel of a plane:
    a chunk plan that names one is sent as dummy bytes even if it arrives after the cancel."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()

    def add(self, transfer_id: str) -> None:
        with self._lock:
            self._ids[transfer_id] = None
            while len(self._ids) > _MAX_CANCELLED:
                self._ids.popitem(last=False)

    def __contains__(self, transfer_id: object) -> bool:
        with self._lock:
            return transfer_id in self._ids


def adjacent_ptr(tensors: Sequence[torch.Tensor], sizes: Sequence[int], device: torch.device) -> int | None:
    """Device address of ``tensors`` when they lie back to back on ``device`` (one NCCL message can
    then cover them in place), else None. Pointer arithmetic only: no tensor is created."""
    first = tensors[0]
    if not first.is_cuda or first.device != device:
        return None
    start = address = first.data_ptr()
    for tensor, size in zip(tensors, sizes, strict=True):
        if tensor.data_ptr() != address or not tensor.is_contiguous():
            return None
        address += size
    return start


@dataclasses.dataclass
class _Batch:
    """One chunk launched as one NCCL group, completed by one event."""

    event: torch.cuda.Event
    chunk: ChunkPlan
    items: list[SendItem] | list[RecvItem] | None  # None: dummy bytes (cancelled transfer)
    keepalive: list[torch.Tensor]
    issued_at: float
    status_slot: int = -1  # receiver: slot of the chunk's status word in the channel's ring
    launch_s: tuple[float, float] = (0.0, 0.0)  # perf_counter before/after the launch
    launch_cpu_us: float = 0.0  # CPU time of the launching thread during the launch (vs wall: waits)
    steps_us: tuple[int, ...] = ()  # the launch's marks (see _Channel.mark), us after its start
    # receiver with device consumers: the receive's own event (``event`` is then the consumers' end)
    recv_event: torch.cuda.Event | None = None
    # zero-copy staging buffers the chunk used: back to the pool once ``event`` completed
    pooled: list[NcclBuffer] = dataclasses.field(default_factory=list)


_Work = list[tuple[ChunkPlan, list[SendItem] | list[RecvItem] | None]]


class _Channel:
    """Common machinery of both directions (see the module docstring)."""

    rank = 0

    def __init__(
        self,
        peer_instance: str,
        device: torch.device,
        config: NcclPlaneConfig,
        callbacks: PlaneCallbacks,
        on_dead: Callable[[_Channel, str | None], None],
        cancelled: CancelledSet,
        memory: ZeroCopyMemory | None = None,
    ) -> None:
        self.peer_instance = peer_instance
        # the plane's registrable memory; zero_copy: this communicator moves only registered buffers
        # (the receiver decides in its offer, the sender follows; see NcclPlaneConfig.zero_copy)
        self.memory = memory
        self.zero_copy = False
        self.device = device
        self.config = config
        self.callbacks = callbacks
        self._on_dead = on_dead
        self.cancelled = cancelled
        self.stream = torch.cuda.Stream(device=device)  # NCCL work (and staging copies)
        self.delivery_stream = torch.cuda.Stream(device=device)  # current stream of callbacks/sinks
        self.cond = threading.Condition()
        self.comm: NcclComm | None = None  # lane 0
        self.comms: list[NcclComm] = []  # every lane's communicator, lane 0 first (once joined)
        self.lane_streams: list[torch.cuda.Stream] = []  # the stream each lane's NCCL work runs on
        self.offer: CommOffer | None = None
        self.inflight: collections.deque[_Batch] = collections.deque()
        self.closed = False
        self.condemned = False  # the janitor decided to fail or close this channel
        self.failing = False
        self.broken: str | None = None  # what the peer sent broke the channel: the janitor fails it
        self.joined = False  # the communicator is up (both ranks joined)
        self.warmed = False  # every lane completed a chunk (connections set up): inline launches allowed
        self._warm_lanes: set[int] = set()
        self._launch_lock = threading.Lock()
        self.join_started: float | None = None
        self.busy_since: float | None = None  # issuer inside NCCL calls since
        self.last_active = time.monotonic()
        # (seq, bytes, launch start, launched, completion seen, launch CPU us, step marks us) of recent
        # chunks, for benchmarks and debugging
        self.trace: collections.deque[tuple[int, int, float, float, float, float, tuple[int, ...]]] = (
            collections.deque(maxlen=512)
        )
        self._marks: list[float] = []
        self._threads: list[threading.Thread] = []

    # --- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        for name, target in (("issuer", self._issue_loop), ("completer", self._complete_loop)):
            thread = threading.Thread(target=self._failing_on_error, args=(name, target),
                                      name=f"kvwire-nccl-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self, abort: bool = True) -> None:
        """Stop both threads and release the communicator (abort, or destroy when idle)."""
        with self.cond:
            if self.closed:
                return
            self.closed = True
            idle = not self.inflight and self.busy_since is None
            self.cond.notify_all()
        self._release_comm()
        if self.memory is not None and idle:
            for comm in self.comms:
                # before NCCL's own teardown of them (see deregister_all); only when nothing is in
                # flight: a deregistration unmaps the buffer from the peer, whose kernel may be
                # writing it (then the abort alone stops both ends' kernels first)
                self.memory.deregister_all(comm)
        if abort or not idle:
            if not abort_all(self.comms):
                log.warning("NCCL abort of the channel with %s did not return in time", self.peer_instance)
        else:
            for comm in self.comms:
                comm.destroy()
        if self.memory is not None:
            for comm in self.comms:
                self.memory.forget(comm)  # its registrations went with it
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)

    def _failing_on_error(self, name: str, loop: Callable[[], None]) -> None:
        """Run the issuer or completer loop; if it raises, the channel fails (its transfers fail
        ``peer_lost`` through the plane) instead of the thread ending unseen with work still queued."""
        try:
            loop()
        except Exception as exc:
            log.exception("NCCL %s thread of the channel with %s failed", name, self.peer_instance)
            self.fail(f"peer_lost: NCCL {name} thread failed: {type(exc).__name__}: {exc}")

    def fail(self, reason: str) -> None:
        """The communicator broke: abort it and tell the plane (which reports the peer failed)."""
        with self.cond:
            if self.closed or self.failing:
                return
            self.failing = True
        log.warning("NCCL channel with %s failed: %s", self.peer_instance, reason)
        self.close(abort=True)
        self._on_dead(self, reason)

    def cancel(self, transfer_id: str) -> None:
        """(The plane already added the id to the shared set.) Drop unlaunched state, wake the issuer."""
        with self.cond:
            self._forget(transfer_id)
            self.cond.notify_all()

    def check(self, now: float) -> str | None:
        """Janitor (plane thread): why this channel must fail now, "idle" to close it, or None.
        Gives a verdict at most once."""
        with self.cond:
            if self.closed or self.condemned:
                return None
            verdict = self._verdict(now)
            comms = list(self.comms) if verdict is None and self.inflight else []
        for comm in comms:
            try:
                comm.check_healthy()
            except TransferError as exc:
                verdict = str(exc)
                break
        if verdict is not None:
            with self.cond:
                if self.condemned:
                    return None
                self.condemned = True
        return verdict

    def _verdict(self, now: float) -> str | None:
        if self.broken is not None:
            return self.broken
        stall = self.config.stall_timeout_s
        if self.busy_since is not None and now - self.busy_since > stall:
            return "an NCCL call blocked past stall_timeout_s"
        if self.inflight and now - self.inflight[0].issued_at > stall:
            return "an operation stalled past stall_timeout_s"
        joining = not self.joined and self.join_started is not None
        if joining and now - self.join_started > self.config.init_timeout_s:  # type: ignore[operator]
            return "communicator init timed out"
        busy = self.inflight or self._has_work() or self.busy_since is not None
        if not busy and now - self.last_active > self._idle_limit_s():
            return "idle"
        return None

    def close_idle(self) -> None:
        log.info("closing idle NCCL channel with %s", self.peer_instance)
        self.close(abort=False)
        self._on_dead(self, None)

    def mark(self) -> None:
        """Note the time of a step of the current launch (kept in the chunk trace)."""
        self._marks.append(time.perf_counter())

    # --- lanes --------------------------------------------------------------------------------------
    def _lane(self, chunk: ChunkPlan) -> tuple[NcclComm, torch.cuda.Stream]:
        """The communicator and stream that carry ``chunk`` (its plan names the lane; plans naming a
        lane the offer lacks never get here, see ``NcclPlane.on_peer_info``)."""
        return self.comms[chunk.lane], self.lane_streams[chunk.lane]

    def _new_lane_streams(self, count: int) -> list[torch.cuda.Stream]:
        """The streams of ``count`` lanes (called once joined)."""
        return [self.stream] + [torch.cuda.Stream(device=self.device) for _ in range(count - 1)]

    # --- zero-copy memory (issuer thread, or the thread that launches) -----------------------------
    def _registered(self, address: int, num_bytes: int, comm: NcclComm) -> bool:
        """``[address, address + num_bytes)`` lies in the plane's registrable memory, registered with
        ``comm`` (now, the first time that communicator moves that buffer)."""
        if self.memory is None:
            return False
        buffer = self.memory.find(address, num_bytes)
        if buffer is None:
            return False
        self.memory.register(comm, buffer)
        return True

    def _staging(self, num_bytes: int, pooled: list[NcclBuffer], comm: NcclComm) -> torch.Tensor:
        """A contiguous buffer for one message on the current stream: with zero-copy a registered
        one (with ``comm``) from the pool (added to ``pooled``: back to the pool when the chunk
        completed), else one from the caching allocator."""
        if not self.zero_copy:
            return torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        buffer = self._take_registered(num_bytes, comm)
        pooled.append(buffer)
        return buffer.tensor[:num_bytes]

    def _take_registered(self, num_bytes: int, comm: NcclComm) -> NcclBuffer:
        """A pooled buffer of at least ``num_bytes``, registered with ``comm``."""
        assert self.memory is not None
        buffer = self.memory.take(num_bytes)
        self.memory.register(comm, buffer)
        return buffer

    # --- hooks for the two directions ----------------------------------------------------------------
    def _forget(self, transfer_id: str) -> None:
        """Drop not-yet-launched state of a cancelled transfer (cond held)."""

    def _has_work(self) -> bool:
        raise NotImplementedError

    def _take_work(self) -> _Work:
        raise NotImplementedError

    def _launch(self, chunk: ChunkPlan, items: list[SendItem] | list[RecvItem] | None) -> _Batch:
        raise NotImplementedError

    def _launch_next(self, work: _Work, hits_only: bool = False) -> list[_Batch]:
        """Launch the first chunk of ``work`` (or more, in one go) and pop what was launched; with
        ``hits_only`` only a graph replay (else nothing: an empty list)."""
        if hits_only:
            return []
        chunk, items = work.pop(0)
        return [self._launch(chunk, items)]

    def _untake(self, work: _Work) -> None:
        """Put taken, unlaunched work back (cond held)."""
        raise NotImplementedError

    def _replays(self, config: NcclPlaneConfig) -> bool:
        """True when this direction replays captured graphs."""
        return False

    def _release_comm(self) -> None:
        """Last call before the communicator is aborted or destroyed."""

    def _deliver(self, batches: list[_Batch]) -> None:
        """Report completed batches (in issue order), one callback per run of one transfer."""
        raise NotImplementedError

    def _needs_order(self, batch: _Batch) -> bool:
        """True when the batch's callbacks may enqueue GPU work that must follow its data (a
        receiver's host sinks): the delivery stream then waits for the batch's event first."""
        return False

    def _coalesce(self, batch: _Batch, following: _Batch) -> bool:
        """True when ``batch``'s report may wait for ``following``'s (the next in flight): the
        completer then reports both with one hold of the GIL instead of two. Each Python wake-up
        between two chunks of a transfer competes for the GIL with the threads that act on the
        transfer's end (on a slow host, ~50-100 us per chunk right when the last chunk lands)."""
        return False

    def _idle_limit_s(self) -> float:
        return self.config.idle_close_s

    # --- threads ----------------------------------------------------------------------------------------
    def _join(self) -> bool:
        """Join the communicator (blocking NCCL init on a helper thread: a peer that never joins
        leaves that thread parked in NCCL; the janitor fails the channel at ``init_timeout_s``)."""
        with self.cond:
            while self.offer is None and not self.closed:
                self.cond.wait(timeout=_WAIT_PERIOD_S)
            if self.closed or self.offer is None:
                return False
            offer = self.offer
            self.join_started = time.monotonic()
        outcome: list[list[NcclComm] | TransferError] = []
        done = threading.Event()

        def join() -> None:
            # every lane in the offer's order (both ends: a blocking init waits for the peer's)
            torch.cuda.set_device(self.device)
            comms: list[NcclComm] = []
            try:
                for unique_id in offer.unique_ids:
                    comms.append(NcclComm.begin(unique_id, self.rank, 2, self.config.comm_config))
            except TransferError as exc:
                for comm in comms:
                    comm.abort()
                outcome.append(exc)
            else:
                outcome.append(comms)
            done.set()
            with self.cond:
                late = self.closed
            if late and isinstance(outcome[0], list):
                for comm in outcome[0]:
                    comm.abort()  # the channel gave up meanwhile

        threading.Thread(target=join, name="kvwire-nccl-join", daemon=True).start()
        while not done.wait(timeout=_WAIT_PERIOD_S):
            with self.cond:
                if self.closed:
                    return False
        result = outcome[0]
        if isinstance(result, TransferError):
            self.fail(f"communicator init: {result}")
            return False
        if offer.zero_copy and (self.memory is None or not all(c.can_register for c in result)):
            for comm in result:
                comm.abort()
            self.fail("the receiver asked for zero-copy messages, which this process cannot register")
            return False
        with self.cond:
            if self.closed:
                for comm in result:
                    comm.abort()
                return False
            self.comms = result
            self.comm = result[0]
            self.lane_streams = self._new_lane_streams(len(result))
            self.zero_copy = offer.zero_copy
            self.joined = True
            self.last_active = time.monotonic()
            self.cond.notify_all()
        return True

    def _issue_loop(self) -> None:
        torch.cuda.set_device(self.device)
        if not self._join():
            return
        while True:
            with self.cond:
                while not self.closed and not self._has_work():
                    self.cond.wait(timeout=_WAIT_PERIOD_S)
                if self.closed:
                    return
            if not self.launch_pending(wait=True):
                return

    def launch_inline(self) -> None:
        """Launch on the calling (agent) thread what is launchable: saves a thread hand-off (and a GIL
        switch). Only replays of captured graphs (``send_graphs``: one non-blocking launch, see
        ``graphs``), and only once the communicator carried a first chunk (connection setup, which may
        wait for the peer, stays on the issuer thread)."""
        if not self.warmed or not self._replays(self.config):
            return
        with torch.cuda.device(self.device):
            self.launch_pending(hits_only=True)

    def launch_pending(self, hits_only: bool = False, wait: bool = False) -> bool:
        """Take and launch every launchable chunk; one launcher at a time (a caller that finds another
        launching returns: that one, or the issuer it notified, picks the work up; the issuer waits a
        moment first, ``wait``). ``hits_only``: launch only graph replays and hand anything else back
        to the issuer. False on failure."""
        taken = (
            self._launch_lock.acquire(timeout=_WAIT_PERIOD_S) if wait else self._launch_lock.acquire(False)
        )
        if not taken:
            return True
        try:
            with torch.cuda.stream(self.stream):
                while True:
                    with self.cond:
                        if self.closed:
                            return True
                        work = self._take_work()
                        if not work:
                            return True
                        self.busy_since = time.monotonic()
                    try:
                        while work:
                            cpu0 = time.thread_time()
                            started = time.perf_counter()
                            self._marks = []
                            batches = self._launch_next(work, hits_only)  # pops what it launched
                            if not batches:  # hits_only and no hit: the issuer launches the rest
                                with self.cond:
                                    self._untake(work)
                                    self.cond.notify_all()
                                return True
                            ended = time.perf_counter()
                            cpu_us = (time.thread_time() - cpu0) * 1e6 / len(batches)
                            steps = tuple(round((m - started) * 1e6) for m in self._marks)
                            for batch in batches:
                                batch.launch_s = (started, ended)
                                batch.launch_cpu_us = cpu_us
                                batch.steps_us = steps
                            with self.cond:
                                self.inflight.extend(batches)
                                self.cond.notify_all()
                    except TransferError as exc:
                        self.fail(f"launch: {exc}")
                        return False
                    finally:
                        with self.cond:
                            self.busy_since = None
        finally:
            self._launch_lock.release()

    def _complete_loop(self) -> None:
        torch.cuda.set_device(self.device)
        deferred: list[_Batch] = []  # completed, reports waiting for a following batch (_coalesce)
        with torch.cuda.stream(self.delivery_stream):
            while True:
                with self.cond:
                    while not self.closed and not self.inflight:
                        self.cond.wait(timeout=_WAIT_PERIOD_S)
                    if self.closed:
                        return
                    batch = self.inflight[0]
                batch.event.synchronize()  # GIL released; ends early when the communicator is aborted
                with self.cond:
                    if self.closed:
                        return
                    self.inflight.popleft()
                    following = self.inflight[0] if self.inflight else None
                    self.last_active = time.monotonic()
                    if self._has_work():  # room for a chunk that waited (max_inflight_chunks);
                        self.cond.notify_all()  # else no wake-up: it would only compete for the GIL
                if batch.pooled and self.memory is not None:
                    for buffer in batch.pooled:  # its GPU work is done
                        self.memory.give(buffer)
                if not self.warmed:
                    self._warm_lanes.add(batch.chunk.lane)
                    self.warmed = len(self._warm_lanes) >= len(self.comms)
                self.trace.append(
                    (
                        batch.chunk.seq,
                        batch.chunk.num_bytes,
                        *batch.launch_s,
                        time.perf_counter(),
                        batch.launch_cpu_us,
                        batch.steps_us,
                    )
                )
                deferred.append(batch)
                room = len(deferred) < _MAX_DEFERRED  # bounded: a receiver's status slots are reused
                if following is not None and room and self._coalesce(batch, following):
                    continue
                for done in deferred:
                    if self._needs_order(done):
                        self.delivery_stream.wait_event(done.event)
                self._deliver(deferred)
                deferred.clear()
