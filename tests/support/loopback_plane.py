"""An in-process data plane with device producers and consumers, on CPU tensors.

It stands in for the NCCL plane in CPU tests of the paths that only a GPU plane takes (the agent
hands it items with ``on_device`` producers and consumers): it calls a message's producer before
"sending" (one message per ``send`` call and producer), copies each item's bytes into the receiver's
posted ``dest``, runs the receiver's consumer with an open gate, and reports ``on_received`` after
the consumer returned — the NCCL plane's contract (:data:`kvwire.transfer.memory.DeviceConsumer`) on
one thread. A cancelled transfer's pending data never reaches its consumer (the gate is closed).
On a CUDA agent device it does the same with device tensors (one process, one GPU): the producers'
one-launch gathers and the consumers' gated scatters then run for real, without NCCL.

Planes find each other through a class-level registry keyed by address; build agents with
``TransferAgent(config, plane_factory=LoopbackPlane)``.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Sequence
from typing import ClassVar

import torch

from kvwire.transfer.config import TransferConfig
from kvwire.transfer.memory import GATE_MAGIC, PeerRef, RecvItem, SendItem
from kvwire.transfer.planes.base import DataPlane, PlaneCallbacks

_OPEN_GATE = torch.tensor([GATE_MAGIC, 1, 1, 0], dtype=torch.int32)
_CLOSED_GATE = torch.tensor([GATE_MAGIC, 1, 0, 0], dtype=torch.int32)


class LoopbackPlane(DataPlane):
    supports_device_producers = True
    supports_device_consumers = True
    _planes: ClassVar[dict[str, LoopbackPlane]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, config: TransferConfig, instance_id: str, board: object = None) -> None:
        del board  # a plane factory takes the process's HealthBoard; this fake supervises nothing
        self.device = torch.device(config.device)
        self.instance_id = instance_id
        self._address = f"loopback:{instance_id}"
        self._callbacks: PlaneCallbacks | None = None
        self._lock = threading.Lock()
        self._posted: dict[tuple[str, int], RecvItem] = {}  # (transfer id, layer) -> posted receive
        self._cancelled: set[str] = set()
        self._work: queue.Queue[tuple[PeerRef, list[SendItem]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="loopback-plane", daemon=True)
        self.producer_calls = 0  # messages whose producer ran
        self.consumer_calls = 0  # messages whose consumer ran
        self.gate_closed_drops = 0  # messages that reached a cancelled receive
        self.items_with_consumer: collections.Counter[str] = collections.Counter()

    def start(self, callbacks: PlaneCallbacks) -> None:
        self._callbacks = callbacks
        with self._registry_lock:
            self._planes[self._address] = self
        self._thread.start()

    @property
    def address(self) -> str:
        return self._address

    def allocate(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, device=self.device)

    def send(self, peer: PeerRef, items: Sequence[SendItem]) -> None:
        self._work.put((peer, list(items)))

    def post_recv(self, peer: PeerRef, items: Sequence[RecvItem]) -> None:
        del peer
        with self._lock:
            for item in items:
                self._posted[(item.transfer_id, item.layer_index)] = item
                if item.on_device is not None:
                    self.items_with_consumer[item.transfer_id] += 1

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            self._cancelled.add(transfer_id)
            for key in [k for k in self._posted if k[0] == transfer_id]:
                del self._posted[key]

    def drop_peer(self, peer_instance_id: str) -> None:
        del peer_instance_id

    def close(self) -> None:
        with self._registry_lock:
            self._planes.pop(self._address, None)
        self._work.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    # --- the "wire" (this plane's thread) -------------------------------------------------------

    def _run(self) -> None:
        while (work := self._work.get()) is not None:
            peer, items = work
            by_producer: dict[int, list[SendItem]] = collections.defaultdict(list)
            for item in items:
                if item.on_device is not None:
                    by_producer[id(item.on_device)].append(item)
            for group in by_producer.values():  # one "message" per producer: gather, then send
                assert group[0].on_device is not None
                group[0].on_device(group)
                self.producer_calls += 1
            with self._registry_lock:
                receiver = self._planes.get(peer.data_address)
            for item in items:
                if receiver is not None and receiver._land(self.instance_id, item):
                    assert self._callbacks is not None
                    self._callbacks.on_sent(peer.instance_id, item.transfer_id, [item.layer_index])

    def _land(self, sender_id: str, item: SendItem) -> bool:
        with self._lock:
            posted = self._posted.pop((item.transfer_id, item.layer_index), None)
            cancelled = item.transfer_id in self._cancelled
        if posted is None:
            if cancelled:
                self.gate_closed_drops += 1
            return False
        if item.ready_event is not None:
            item.ready_event.wait()  # the caller's writes before the copy (CUDA)
        posted.dest.copy_(item.tensor.reshape(-1).view(torch.uint8))
        if posted.on_device is not None:
            with self._lock:
                gate = _CLOSED_GATE if item.transfer_id in self._cancelled else _OPEN_GATE
            posted.on_device([posted], gate.to(posted.dest.device))
            self.consumer_calls += 1
        if posted.dest.is_cuda:
            torch.cuda.current_stream(posted.dest.device).synchronize()  # reported once written
        assert self._callbacks is not None
        self._callbacks.on_received(sender_id, item.transfer_id, [item.layer_index])
        return True
