"""Where what reaches an agent goes: control messages, ticks and plane reports, to the side that
holds the transfer they name.

The control thread (:mod:`kvwire.transfer.control`) calls ``on_message``, ``on_reject``, ``on_tick``,
``on_unreachable`` and ``on_control_dead``; the data plane's threads call the
:class:`~kvwire.transfer.planes.base.PlaneCallbacks` methods. Each takes ``core.lock``; a sink runs
without it. Epochs are checked here, once per message, before any side sees it: a new instance id at
a known endpoint fails the old process's transfers (decision 092).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvwire.transfer.control import TICK_S
from kvwire.transfer.control_messages import Abort, Ack, AnyMsg, Grant, Offer, Pull, Renew, Trailer
from kvwire.transfer.core import Core
from kvwire.transfer.enums import FailReason
from kvwire.transfer.lease import PeerState
from kvwire.transfer.receiver import Receiver
from kvwire.transfer.sender import Sender
from kvwire.transfer.types import LayerSink

log = logging.getLogger("kvwire.transfer")


class Routes:
    """The agent's control-thread and plane-thread entry points (see the module docstring)."""

    def __init__(self, core: Core, sender: Sender, receiver: Receiver) -> None:
        self.core = core
        self.sender = sender
        self.receiver = receiver
        self._next_expiry = 0.0  # control thread only: when on_tick next checks deadlines

    # --- control thread ----------------------------------------------------------------------------------

    def on_message(self, msg: AnyMsg) -> None:
        core = self.core
        with core.lock:
            if core.closed:
                return
            self._check_epoch(msg)
            if msg.dst_id and msg.dst_id != core.instance_id and not isinstance(msg, (Offer, Pull)):
                self.on_reject(f"stale {type(msg).__name__} for epoch {msg.dst_id} (now {core.instance_id})")
                # an early Grant (decision 110) went to this endpoint's previous process on what
                # the receiver knew of it: that process never had the transfer, nothing was lost;
                # the receiver grants afresh when this process offers it
                if not isinstance(msg, Abort) and not (isinstance(msg, Grant) and msg.early):
                    reason = f"{FailReason.PEER_LOST.value}: peer restarted"
                    core.send_abort(msg.src_endpoint, msg.transfer_id, reason, msg.src_id)
                return
            self._route(msg)

    def _route(self, msg: AnyMsg) -> None:
        if isinstance(msg, Offer):
            self.receiver.on_offer(msg)
        elif isinstance(msg, Grant):
            self.sender.on_grant(msg)
        elif isinstance(msg, Ack):
            self.sender.on_ack(msg)
        elif isinstance(msg, Trailer):
            self.receiver.on_trailer(msg)
        elif isinstance(msg, Pull):
            self.sender.on_pull(msg)
        elif isinstance(msg, Renew):
            self._on_renew(msg)
        elif isinstance(msg, Abort):
            self.sender.on_abort(msg.transfer_id, msg.src_endpoint, msg.reason)
            self.receiver.on_abort(msg.transfer_id, msg.src_id, msg.reason, msg.src_endpoint)

    def _on_renew(self, msg: Renew) -> None:
        """The peer is alive: extend our lease on the transfer; answer a non-reply with our state."""
        core, tid, endpoint = self.core, msg.transfer_id, msg.src_endpoint
        sending = self.sender.on_renew(msg)
        promised = self.sender.promises.renewed_by(msg)
        self.sender.early_grants.heard(msg)
        receiving = self.receiver.on_renew(msg)
        if msg.reply:
            return
        if promised and not sending:
            state = PeerState.QUEUED.value
            core.send(endpoint, Renew(**core.header(endpoint, tid, msg.src_id), state=state, reply=True))
            return
        if sending:
            core.send(endpoint, self.sender.renew_msg(endpoint, tid, reply=True))
            return
        if receiving:
            core.send(endpoint, self.receiver.renew_msg(endpoint, tid, reply=True))
            return
        # the asker receives if it reports so: our side of the transfer is then the send side
        side = self.sender.side if msg.state == PeerState.RECEIVING.value else self.receiver.side
        ended = core.tombstones.get(side, tid)
        if ended is not None and ended != "done":
            core.send_abort(endpoint, tid, ended, msg.src_id)
            return
        state = PeerState.DONE if ended == "done" else PeerState.UNKNOWN
        core.send(endpoint, Renew(**core.header(endpoint, tid, msg.src_id), state=state.value, reply=True))

    def _check_epoch(self, msg: AnyMsg) -> None:
        """A new instance id at a known endpoint: the old process is gone; fail its transfers."""
        core = self.core
        known = core.peer_ids.heard(msg.src_endpoint, msg.src_id)
        if known is None or known == msg.src_id:
            return
        log.warning("peer %s restarted (instance %s -> %s)", msg.src_endpoint, known, msg.src_id)
        core.stats.add("peers_restarted")
        reason = f"{FailReason.PEER_LOST.value}: peer {msg.src_endpoint} restarted"
        self._fail_peer(known, reason, restarted=True)

    def _fail_peer(self, peer_id: str, reason: str, restarted: bool = False) -> None:
        """``restarted``: a new process took the peer's endpoint (not a link of a live peer that broke)."""
        self.sender.fail_peer(peer_id, reason)
        self.receiver.fail_peer(peer_id, reason, restarted)
        self.core.plane.drop_peer(peer_id)

    def on_unreachable(self, endpoint: str) -> None:
        """The peer at ``endpoint`` refuses connections (its process is gone): fail its transfers
        now rather than at their leases (peer_watch, decision 088)."""
        with self.core.lock:
            if self.core.closed:
                return
            reason = f"{FailReason.PEER_LOST.value}: {endpoint} refuses connections"
            failed = self.sender.fail_endpoint(endpoint, reason)
            failed += self.receiver.fail_endpoint(endpoint, reason)
        if failed:
            log.warning("transfer peer %s refuses connections: failed its %d transfer(s)", endpoint, failed)

    def on_reject(self, reason: str) -> None:
        self.core.stats.add("messages_rejected")
        # once, then a summary a minute: a peer sending garbage in a loop must not flood the log
        self.core.rejects.refused("rejected", reason)

    def on_tick(self) -> None:
        """After every control-loop wake-up: flush acks; scan deadlines at most every ``TICK_S``
        (each arrived layer wakes the loop, and the scans walk every transfer in flight)."""
        with self.core.lock:
            if self.core.closed:
                return
            now = self.core.now()
            if now >= self._next_expiry:
                self._next_expiry = now + TICK_S
                self.sender.expire(now)
                self.receiver.expire(now)
                self.sender.renew(now)
                self.receiver.renew(now)
            self.receiver.arrivals.flush_acks()

    def on_control_dead(self, error: BaseException) -> None:
        """Control thread, once, as supervision gives it up: nothing can move or expire any more, so
        every transfer fails now (callers see it in ``poll``) and new ones are refused."""
        what = f"{type(error).__name__}: {error}"
        reason = f"{FailReason.CLOSED.value}: the transfer control loop is dead ({what})"
        log.error("transfer agent %s: %s; failing every transfer in flight", self.core.instance_id, reason)
        with self.core.lock:
            if self.core.closed:
                return
            self.core.dead = reason
            self.sender.close(reason)
            self.receiver.close(reason)

    def deliver_held(self, transfer_id: str) -> None:
        """Control thread: hand the layers buffered before ``expect`` to the sink it named."""
        with self.core.lock:
            work = self.receiver.arrivals.take_held_for_sink(transfer_id)
        for index, sink, tensor in work:
            self._run_sink(transfer_id, index, sink, tensor)

    def _run_sink(self, transfer_id: str, index: int, sink: LayerSink, tensor: torch.Tensor) -> None:
        try:
            sink(index, tensor)
            if tensor.is_cuda:  # the sink's copy/scatter is async: finish it before the buffer is reused
                done = torch.cuda.Event()  # and before finished_recving (only the sink's work: the
                done.record(torch.cuda.current_stream(tensor.device))  # plane's streams may hold
                done.synchronize()  # receives still waiting for data)
        except Exception as exc:
            log.exception("sink of transfer %s failed on layer %d", transfer_id, index)
            with self.core.lock:
                self.receiver.fail(transfer_id, f"{FailReason.SINK.value}: {exc!r}", notify=True)
            return
        with self.core.lock:
            self.receiver.arrivals.delivered(transfer_id, index)

    # --- data-plane callbacks (plane threads): PlaneCallbacks -------------------------------------------

    def on_sent(self, peer_instance_id: str, transfer_id: str, layer_indices: Sequence[int]) -> None:
        with self.core.lock:
            for index in layer_indices:
                self.sender.queue.on_sent(transfer_id, index)

    def on_received(self, peer_instance_id: str, transfer_id: str, layer_indices: Sequence[int]) -> None:
        sinks = []
        with self.core.lock:  # once per message (a plane's thread holds the GIL meanwhile)
            if self.core.closed:
                return
            for index in layer_indices:
                work = self.receiver.arrivals.on_received(peer_instance_id, transfer_id, index)
                if work is not None:
                    sinks.append((index, *work))
        control = self.core.control
        if control is not None:
            control.wake()  # flush the acks soon
        for index, sink, tensor in sinks:
            self._run_sink(transfer_id, index, sink, tensor)

    def on_transfer_failed(self, transfer_id: str, reason: str) -> None:
        with self.core.lock:
            self.sender.fail(transfer_id, reason, notify=True)
            self.receiver.fail(transfer_id, reason, notify=True)

    def on_peer_failed(self, peer_instance_id: str, reason: str) -> None:
        with self.core.lock:
            if not self.core.closed:
                self._fail_peer(peer_instance_id, reason)

    def on_protocol_error(self, reason: str) -> None:
        self.on_reject(reason)

    def peer_endpoint(self, peer_instance_id: str) -> str | None:
        with self.core.lock:
            return self.core.peer_ids.endpoint_of(peer_instance_id)

    def on_device_copy(self, num_bytes: int, seconds: float) -> None:
        self.core.stats.add("device_copy_bytes", num_bytes)
        self.core.stats.add("device_copy_ns", round(seconds * 1e9))
        self.core.stats.add("device_copy_batches", 1)
