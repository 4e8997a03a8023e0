"""In-process stand-in for kvwire.transfer.TransferAgent with the same interface and event rules.

Agents on one :class:`FakeFabric` reach each other by endpoint. Layers are delivered synchronously
unless the fabric is ``paused`` (then queued until ``flush``), so tests control arrival order.
``kill(endpoint)`` makes every transfer with that agent fail with ``peer_lost`` at the next poll.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from kvwire.connector.base import ConnectorOutput, ScheduledChunk, StepInfo
from kvwire.connector.config import ConnectorConfig, EngineInfo
from kvwire.connector.metrics import connector_metrics
from kvwire.connector.scheduler import KvwireSchedulerConnector
from kvwire.connector.worker import KvwireWorkerConnector
from kvwire.protocol.kv_params import KVTransferParams, Role
from kvwire.transfer.enums import KVLayout
from kvwire.transfer.memory import BlockTarget, LayerSink, LayerSpec, PagedKV, TransferEvents

_ids = itertools.count()


@dataclasses.dataclass
class _FakeSend:
    peer: str | None
    layers: list[LayerSpec]
    deadline: float
    with_trailer: bool
    data: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    trailer: bytes | None = None
    delivered: set[int] = dataclasses.field(default_factory=set)
    trailer_delivered: bool = False


@dataclasses.dataclass
class _FakeRecv:
    num_layers: int | None
    sink: LayerSink | None
    deadline: float
    peer: str | None = None
    arrived: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    sunk: set[int] = dataclasses.field(default_factory=set)
    trailer: bytes | None = None
    complete_from_sender: bool = False


class FakeFabric:
    def __init__(self) -> None:
        self.agents: dict[str, FakeAgent] = {}
        self.paused = False
        self._queue: list[Callable[[], None]] = []
        self.dead: set[str] = set()

    def agent(self, name: str, default_deadline_s: float = 30.0) -> FakeAgent:
        agent = FakeAgent(self, name, default_deadline_s)
        self.agents[agent.endpoint] = agent
        return agent

    def post(self, action: Callable[[], None]) -> None:
        if self.paused:
            self._queue.append(action)
        else:
            action()

    def flush(self) -> None:
        self.paused = False
        queue, self._queue = self._queue, []
        for action in queue:
            action()

    def kill(self, endpoint: str) -> None:
        self.dead.add(endpoint)


class FakeAgent:
    def __init__(self, fabric: FakeFabric, name: str, default_deadline_s: float) -> None:
        self.fabric = fabric
        self._endpoint = f"fake://{name}"
        self._instance_id = f"{name}-{next(_ids)}"
        self.default_deadline_s = default_deadline_s
        self.sends: dict[str, _FakeSend] = {}
        self.recvs: dict[str, _FakeRecv] = {}
        self.promises: list[str] = []  # transfer ids promised (P accepted the request)
        self._done_recvs: dict[str, _FakeRecv] = {}
        self._lock = threading.Lock()
        self._sent: set[str] = set()
        self._recvd: set[str] = set()
        self._failed: dict[str, str] = {}
        self.aborted: list[tuple[str, str]] = []
        self.closed = False
        self.paged: PagedKV | None = None
        # transfers a (simulated) stalled sender may still write into: the tests set it
        self.unsettled_transfers: dict[str, int] = {}

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor], layout: KVLayout) -> None:
        self.paged = PagedKV(kv_caches, layout)

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def instance_id(self) -> str:
        return self._instance_id

    def _deadline(self, deadline_s: float | None) -> float:
        return time.monotonic() + (self.default_deadline_s if deadline_s is None else deadline_s)

    # send side
    def start_send(
        self, transfer_id: str, peer_endpoint: str | None, layers: Sequence[LayerSpec], *,
        deadline_s: float | None = None, with_trailer: bool = False,
        pull_by: str | Sequence[str] | None = None, limit_s: float | None = None,
    ) -> None:
        del pull_by  # the fake fabric has no third agents
        deadline = self._deadline(deadline_s)
        self.sends[transfer_id] = _FakeSend(peer_endpoint, list(layers), deadline, with_trailer)

    def send_layer(
        self, transfer_id: str, layer_index: int, tensor: torch.Tensor, ready_event: Any = None
    ) -> None:
        send = self.sends[transfer_id]
        spec = send.layers[layer_index]
        assert tuple(tensor.shape) == spec.shape and tensor.dtype == spec.dtype, (tensor.shape, spec)
        send.data[layer_index] = tensor
        self._pump(transfer_id)

    def send_blocks(
        self, transfer_id: str, layer_index: int, block_ids: torch.Tensor, ready_event: Any = None,
        heads: range | None = None,
    ) -> None:
        assert self.paged is not None, "register_kv_caches first"
        data = self.paged.heads(heads).gather(layer_index, block_ids)
        self.send_layer(transfer_id, layer_index, data, ready_event)

    def send_trailer(self, transfer_id: str, payload: bytes) -> None:
        send = self.sends.get(transfer_id)
        if send is not None:
            send.trailer = payload
            self._pump(transfer_id)

    def _pump(self, tid: str) -> None:
        send = self.sends.get(tid)
        if send is None or send.peer is None:
            return
        peer = self.fabric.agents.get(send.peer)
        if peer is None or send.peer in self.fabric.dead:
            return
        for index, tensor in list(send.data.items()):
            if index not in send.delivered:
                send.delivered.add(index)
                self.fabric.post(lambda i=index, t=tensor: peer._deliver(tid, i, t, self.endpoint))
        trailer_ok = not send.with_trailer or send.trailer is not None
        ready = len(send.delivered) == len(send.layers) and trailer_ok
        if ready and not send.trailer_delivered:
            send.trailer_delivered = True  # completion (with the trailer, if any) goes last
            self.fabric.post(lambda: peer._deliver_trailer(tid, send.trailer))
            self.fabric.post(lambda: self._acked(tid))

    def _acked(self, tid: str) -> None:
        if self.sends.pop(tid, None) is not None:
            self._sent.add(tid)

    def _pull(self, tid: str, receiver: str) -> None:
        send = self.sends.get(tid)
        if send is None:
            self.fabric.agents[receiver]._remote_failed(tid, "unknown_transfer: not held")
            return
        send.peer = receiver
        self._pump(tid)

    def promise(
        self, transfer_id: str, peer_endpoint: str, *, deadline_s: float | None = None,
        limit_s: float | None = None,
    ) -> None:
        self.promises.append(transfer_id)

    # receive side
    def expect(
        self, transfer_id: str, *, num_layers: int, sink: LayerSink | None = None,
        deadline_s: float | None = None, pull_from: str | None = None,
        into_blocks: BlockTarget | None = None, accept_from: str | None = None,
        sender: str | None = None, limit_s: float | None = None, pull_slice: Any = None,
    ) -> None:
        assert pull_slice is None, "the fake fabric has no piece pulls (tests/integration/test_pd_tp.py)"
        del accept_from  # the fake fabric has no third agents
        if into_blocks is not None:
            assert self.paged is not None and sink is None, "register_kv_caches first; one destination"
            paged = self.paged.heads(into_blocks.heads)
            sink = lambda index, data: paged.write(index, into_blocks, data)  # noqa: E731
        recv = self.recvs.setdefault(transfer_id, _FakeRecv(None, None, 0.0))
        recv.num_layers, recv.sink, recv.deadline = num_layers, sink, self._deadline(deadline_s)
        if pull_from is not None:
            recv.peer = pull_from
            sender = self.fabric.agents.get(pull_from)
            if sender is not None and pull_from not in self.fabric.dead:
                self.fabric.post(lambda: sender._pull(transfer_id, self.endpoint))
        self._drain(transfer_id)

    def _deliver(self, tid: str, index: int, tensor: torch.Tensor, sender: str) -> None:
        if tid in self._failed:
            return
        recv = self.recvs.setdefault(tid, _FakeRecv(None, None, time.monotonic() + self.default_deadline_s))
        recv.peer = sender
        recv.arrived[index] = tensor.clone()
        self._drain(tid)

    def _deliver_trailer(self, tid: str, payload: bytes | None) -> None:
        recv = self.recvs.setdefault(tid, _FakeRecv(None, None, time.monotonic() + self.default_deadline_s))
        recv.trailer = payload
        recv.complete_from_sender = True
        self._drain(tid)

    def _drain(self, tid: str) -> None:
        recv = self.recvs.get(tid)
        if recv is None or recv.num_layers is None:
            return
        if recv.sink is not None:
            for index, tensor in sorted(recv.arrived.items()):
                if index not in recv.sunk:
                    recv.sink(index, tensor)
                    recv.sunk.add(index)
        if len(recv.arrived) == recv.num_layers and recv.complete_from_sender:
            self._done_recvs[tid] = self.recvs.pop(tid)
            self._recvd.add(tid)

    def take_layers(self, transfer_id: str) -> dict[int, torch.Tensor]:
        return self._done_recvs[transfer_id].arrived

    def take_trailer(self, transfer_id: str) -> bytes | None:
        recv = self._done_recvs.pop(transfer_id, None)
        return None if recv is None else recv.trailer

    # both
    def abort(self, transfer_id: str, reason: str = "aborted") -> None:
        self.aborted.append((transfer_id, reason))
        send = self.sends.pop(transfer_id, None)
        recv = self.recvs.pop(transfer_id, None)
        peer = (send.peer if send else None) or (recv.peer if recv else None)
        if send is not None or recv is not None:
            self._failed[transfer_id] = f"aborted: {reason}"
        if peer is not None and peer in self.fabric.agents:
            other = self.fabric.agents[peer]
            self.fabric.post(lambda: other._remote_failed(transfer_id, f"peer_aborted: {reason}"))

    def _remote_failed(self, tid: str, reason: str) -> None:
        if self.sends.pop(tid, None) is not None or self.recvs.pop(tid, None) is not None:
            self._failed[tid] = reason

    def unsettled(self) -> dict[str, int]:
        return dict(self.unsettled_transfers)

    def poll(self, trailers: bool = False) -> TransferEvents:
        now = time.monotonic()
        for table in (self.sends, self.recvs):
            for tid, item in list(table.items()):
                peer = item.peer
                if peer is not None and peer in self.fabric.dead:
                    del table[tid]
                    self._failed[tid] = "peer_lost: killed"
                elif now > item.deadline:
                    del table[tid]
                    self._failed[tid] = "deadline: expired"
        with self._lock:
            events = TransferEvents(frozenset(self._sent), frozenset(self._recvd), dict(self._failed))
            for tid in self._recvd if trailers else ():
                recv = self._done_recvs.get(tid)
                if recv is not None and recv.trailer is not None:
                    events.trailers[tid] = recv.trailer
            self._sent, self._recvd, self._failed = set(), set(), {}
        return events

    def close(self) -> None:
        self.closed = True


# --- a minimal host-engine harness driving the connector hooks in the documented order -----------



@dataclasses.dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)


def chunk(request: FakeRequest, block_ids: Sequence[int], computed: int, scheduled: int) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=request.request_id,
        block_ids=tuple(block_ids),
        num_computed_tokens=computed,
        num_scheduled_tokens=scheduled,
        num_prompt_tokens=len(request.prompt_token_ids),
    )


def run_step(
    sched: KvwireSchedulerConnector,
    worker: KvwireWorkerConnector,
    kv_caches: Sequence[torch.Tensor],
    chunks: Sequence[ScheduledChunk] = (),
) -> ConnectorOutput:
    """One engine step: metadata -> worker (saves every layer as the forward would) -> output."""
    worker.bind_connector_metadata(sched.build_connector_meta(StepInfo(scheduled=tuple(chunks))))
    worker.start_load_kv()
    for index, cache in enumerate(kv_caches):
        worker.wait_for_layer_load(index)
        if chunks:
            worker.save_kv_layer(index, cache)
    worker.wait_for_save()
    out = worker.get_finished(set())
    worker.clear_connector_metadata()
    sched.update_connector_output(out)
    return out


def poll_until(
    sched: KvwireSchedulerConnector,
    worker: KvwireWorkerConnector,
    kv_caches: Sequence[torch.Tensor],
    done: Callable[[ConnectorOutput], bool],
    timeout_s: float = 5.0,
) -> ConnectorOutput:
    """Step (without scheduled requests) until ``done(output)``; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = run_step(sched, worker, kv_caches)
        if done(out):
            return out
        time.sleep(0.005)
    raise AssertionError("condition not reached before the deadline")


BLOCK = 8


NUM_LAYERS = 3


NUM_BLOCKS = 16


class Side:
    """One instance: scheduler + worker halves, a paged KV cache, and its fake agent."""

    def __init__(self, fabric: FakeFabric, name: str, role: Role, registry: CollectorRegistry,
                 **config: object) -> None:
        self.agent: FakeAgent = fabric.agent(name)
        self.config = ConnectorConfig(role=role, **config)  # type: ignore[arg-type]
        info = EngineInfo(block_size=BLOCK)
        self.metrics = connector_metrics(registry)
        self.sched = KvwireSchedulerConnector(self.config, info, [self.agent.endpoint], metrics=self.metrics)
        self.worker = KvwireWorkerConnector(self.config, info, self.agent, metrics=self.metrics)
        fill = torch.randn if role is Role.PREFILL else torch.zeros
        self.caches = [fill(2, NUM_BLOCKS, BLOCK, 2, 4) for _ in range(NUM_LAYERS)]
        self.worker.register_kv_caches(self.caches)

    def step(self, *chunks):  # type: ignore[no-untyped-def]
        return run_step(self.sched, self.worker, self.caches, chunks)

    def until(self, done):  # type: ignore[no-untyped-def]
        return poll_until(self.sched, self.worker, self.caches, done)


def make_pd(fabric: FakeFabric, registry: CollectorRegistry, **config: object) -> tuple[Side, Side]:
    p = Side(fabric, "p", Role.PREFILL, registry, **config)
    d = Side(fabric, "d", Role.DECODE, CollectorRegistry(), **config)
    return p, d


def push_requests(p: Side, d: Side, prompt_len: int, tid: str = "t1", deadline_s: float = 5.0):  # type: ignore[no-untyped-def]
    prompt = list(range(1, prompt_len + 1))
    p_params = KVTransferParams(transfer_id=tid, role=Role.PREFILL, peer_endpoints=[d.agent.endpoint],
                                deadline_s=deadline_s)
    d_params = KVTransferParams(transfer_id=tid, role=Role.DECODE, peer_endpoints=[p.agent.endpoint],
                                deadline_s=deadline_s)
    preq = FakeRequest("p-" + tid, prompt, p_params.to_dict())
    return preq, FakeRequest("d-" + tid, prompt, d_params.to_dict())
