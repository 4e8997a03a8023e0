"""The bookkeeping of captured sends (kvwire.transfer.planes.nccl.graphs) without a GPU: when a run is
captured, what keys it, what is evicted. Capture and replay themselves are GPU tests
(tests/gpu/test_nccl_graphs.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvwire.transfer.memory import CapturableProducer, SendItem
from kvwire.transfer.planes.nccl.graphs import Captured, SendGraphs, producer_key
from kvwire.transfer.planes.nccl.plane_info import ChunkPlan
from kvwire.transfer.planes.nccl.send import _leading_run
from support.plane_callbacks import RecordingCallbacks


class FakeGraph:
    def __init__(self) -> None:
        self.resets = 0
        self.replays = 0

    def reset(self) -> None:
        self.resets += 1

    def replay(self) -> None:
        self.replays += 1


def _store(capacity: int = 2) -> SendGraphs:
    return SendGraphs(torch.device("cpu"), capacity)


def _put(store: SendGraphs, key: str, graph: FakeGraph) -> Captured:
    """What a successful capture stores (capture itself needs CUDA)."""
    captured = Captured(graph, torch.zeros(2, dtype=torch.int32))  # type: ignore[arg-type]
    store._graphs[key] = captured
    while len(store._graphs) > store.capacity:
        old_key, old = store._graphs.popitem(last=False)
        old.graph.reset()
        store._seen.pop(old_key, None)
    return captured


def test_a_key_is_captured_on_its_second_sighting_only() -> None:
    store = _store()
    assert store.find("a") == (None, False)  # first sighting: launch from Python
    assert store.find("a") == (None, True)  # seen before: capture now
    graph = FakeGraph()
    captured = _put(store, "a", graph)
    assert store.find("a") == (captured, False)
    assert store.find("b", count=False) == (None, False)  # a look only: not a sighting
    assert store.find("b") == (None, False)
    assert store.replay(captured) is True and graph.replays == 1 and store.replays == 1


def test_capacity_evicts_least_recently_used_and_forgets_its_sighting() -> None:
    store = _store(capacity=2)
    graphs = {key: FakeGraph() for key in "abc"}
    for key in "ab":
        store.find(key)
        store.find(key)
        _put(store, key, graphs[key])
    store.find("a")  # a is now the most recently used
    store.find("c")
    store.find("c")
    _put(store, "c", graphs["c"])
    assert graphs["b"].resets == 1 and len(store) == 2
    assert store.find("b") == (None, False)  # evicted keys must be seen again before a new capture


def test_close_resets_every_graph_and_refuses_replays() -> None:
    store = _store()
    graph = FakeGraph()
    captured = _put(store, "a", graph)
    store.close()
    assert graph.resets == 1 and len(store) == 0
    assert store.replay(captured) is False and graph.replays == 0
    assert store.find("a") == (None, False)


def test_zero_capacity_never_captures() -> None:
    store = _store(capacity=0)
    store.find("a")
    assert store.find("a") == (None, False)


class KeyedProducer:
    def __init__(self, key: object) -> None:
        self.key = key

    def __call__(self, items: Sequence[SendItem]) -> None:
        pass

    def capture_key(self, items: Sequence[SendItem]) -> Any:
        if self.key == "raise":
            raise RuntimeError("bug")
        return self.key


def test_producer_key_needs_a_capture_key_method() -> None:
    item = SendItem("t", 0, torch.zeros(4))
    assert isinstance(KeyedProducer(1), CapturableProducer)
    assert producer_key(KeyedProducer(("x", 1)), [item]) == ("x", 1)
    assert producer_key(KeyedProducer(None), [item]) is None
    assert producer_key(KeyedProducer("raise"), [item]) is None  # a buggy key: not capturable
    assert producer_key(lambda items: None, [item]) is None  # a plain producer


def test_leading_run_is_the_real_chunks_of_the_first_transfer() -> None:
    def plan(seq: int, tid: str) -> ChunkPlan:
        return ChunkPlan(comm_id="c", seq=seq, transfer_id=tid, layers=[seq], num_bytes=4)

    items = [SendItem("a", 0, torch.zeros(1))]
    work: Any = [(plan(0, "a"), items), (plan(1, "a"), items), (plan(2, "b"), items)]
    assert [c.seq for c, _ in _leading_run(work, set())] == [0, 1]
    assert _leading_run(work, {"a"}) == []  # cancelled: dummy bytes from Python
    assert _leading_run([(plan(0, "a"), None), *work], set()) == []  # a dummy chunk first


def test_device_signal_states_and_driver_entry_point() -> None:
    from kvwire.errors import TransferError
    from kvwire.transfer.planes.nccl import device_signal
    from kvwire.transfer.planes.nccl.send import _signal_of

    assert [s.value for s in device_signal.SignalState] == [0, 1, 2]  # wait GEQ READY passes on both
    assert _signal_of([SendItem("t", 0, torch.zeros(1))]) is None
    assert _signal_of([]) is None
    if torch.cuda.is_available():
        return
    device_signal._wait_value32.cache_clear()
    try:  # no libcuda on a CPU machine: a typed error, not an OSError
        device_signal._wait_value32()
    except TransferError as exc:
        assert "cuStreamWaitValue32" in str(exc)
    else:
        raise AssertionError("expected TransferError without libcuda")
    finally:
        device_signal._wait_value32.cache_clear()


def _batch(transfer_id: str, event: object, consumed: bool) -> Any:
    from kvwire.transfer.planes.nccl.channel import _Batch

    chunk = ChunkPlan(comm_id="c", seq=0, transfer_id=transfer_id, layers=[0], num_bytes=8)
    return _Batch(event, chunk, None, [], 0.0, recv_event=object() if consumed else None)  # type: ignore[arg-type]


def test_completer_coalesces_reports_only_where_nothing_waits_on_them() -> None:
    """Reports of a graph replay's chunks (one event) and of one transfer's GPU-consumed chunks wait
    for the next; chunks with host delivery, or of another transfer, are reported at once."""
    from kvwire.transfer.planes.nccl.recv import RecvChannel
    from kvwire.transfer.planes.nccl.send import SendChannel

    replay, other = object(), object()
    # the hooks read nothing of the channel: called unbound (building a channel needs CUDA streams)
    send = SendChannel._coalesce
    assert send(None, _batch("t", replay, False), _batch("t", replay, False))  # type: ignore[arg-type]
    assert not send(None, _batch("t", replay, False), _batch("t", other, False))  # type: ignore[arg-type]
    recv = RecvChannel._coalesce
    assert recv(None, _batch("t", replay, True), _batch("t", other, True))  # type: ignore[arg-type]
    assert not recv(None, _batch("t", replay, True), _batch("u", other, True))  # type: ignore[arg-type]
    assert not recv(None, _batch("t", replay, False), _batch("t", other, True))  # type: ignore[arg-type]
    assert not recv(None, _batch("t", replay, True), _batch("t", other, False))  # type: ignore[arg-type]


def _chunk_batch(seq: int, transfer_id: str, layers: list[int], real: bool = True) -> Any:
    from kvwire.transfer.planes.nccl.channel import _Batch

    chunk = ChunkPlan(comm_id="c", seq=seq, transfer_id=transfer_id, layers=layers, num_bytes=8)
    items = [SendItem(transfer_id, i, torch.zeros(1)) for i in layers] if real else None
    return _Batch(object(), chunk, items, [], 0.0, status_slot=seq)  # type: ignore[arg-type]


def test_sender_reports_each_transfer_run_once() -> None:
    import threading

    from kvwire.transfer.planes.nccl.channel import CancelledSet
    from kvwire.transfer.planes.nccl.send import SendChannel

    channel = object.__new__(SendChannel)  # _deliver reads only these (a real one needs CUDA streams)
    channel.cancelled, channel.callbacks, channel.peer_instance = CancelledSet(), RecordingCallbacks(), "p"
    channel.cond = threading.Condition()
    channel.cancelled.add("gone")
    batches = [
        _chunk_batch(0, "t", [0, 1]),
        _chunk_batch(1, "t", [2]),
        _chunk_batch(2, "dummy", [0], real=False),
        _chunk_batch(3, "gone", [0]),
        _chunk_batch(4, "u", [0, 1]),
    ]
    channel._deliver(batches)
    assert channel.callbacks.log == [("sent", "t", [0, 1, 2]), ("sent", "u", [0, 1])]  # type: ignore[attr-defined]


def test_receiver_reports_runs_and_what_landed_before_a_failure_first() -> None:
    import threading

    import numpy as np

    from kvwire.transfer.planes.nccl.channel import STATUS_MAGIC, CancelledSet
    from kvwire.transfer.planes.nccl.recv import RecvChannel

    channel = object.__new__(RecvChannel)
    channel.cancelled, channel.callbacks, channel.peer_instance = CancelledSet(), RecordingCallbacks(), "p"
    channel._gate_lock, channel._gated = threading.Lock(), {}
    status = np.zeros((8, 4), dtype=np.int32)
    status[:, 0], status[:, 1] = STATUS_MAGIC, 1
    status[2, 1] = 2  # chunk 2 of "t": the sender gave up (not real)
    status[5, 0] = 0  # chunk 5 of "v": garbled
    channel._status_np = status
    batches = [_chunk_batch(seq, tid, [seq]) for seq, tid in enumerate("tttuuvv")]
    channel._deliver(batches)
    assert channel.callbacks.log == [  # type: ignore[attr-defined]
        ("received", "t", [0, 1]),
        ("failed", "t", "peer_aborted: sender cancelled"),
        ("received", "u", [3, 4]),
        ("failed", "v", "protocol: chunk status garbled"),
    ]


def test_copies_with_slack_are_the_later_gathers_and_the_earlier_scatters() -> None:
    import collections
    import threading

    import torch

    from kvwire.transfer.memory import RecvItem
    from kvwire.transfer.planes.nccl.config import NcclPlaneConfig
    from kvwire.transfer.planes.nccl.plane_info import ChunkPlan, CommOffer
    from kvwire.transfer.planes.nccl.recv import RecvChannel
    from kvwire.transfer.planes.nccl.send import SendChannel

    sender = object.__new__(SendChannel)  # add_plans reads only these (a real one needs CUDA streams)
    sender.cond, sender.plans, sender.next_seq, sender.warmed = threading.Condition(), {}, 0, False
    sender._ordinals, sender._slack, sender.broken = collections.OrderedDict(), set(), None
    sender.config = NcclPlaneConfig()
    plans = [ChunkPlan("c", seq, tid, [seq], 1) for seq, tid in enumerate("ttttuu")]
    sender.add_plans(plans[:3])
    sender.add_plans(plans[3:])  # a transfer's plans may come in several announcements
    assert sender._slack == {2, 3}  # the third and fourth message of "t"; "u" has two only
    assert sender._share(plans[2]) == 0.5 and sender._share(plans[0]) is None

    receiver = object.__new__(RecvChannel)
    receiver.cond, receiver.next_seq = threading.Condition(), 0
    receiver.pending, receiver.unannounced = [], []
    receiver.offer = CommOffer("c", bytes(128))
    receiver.config = NcclPlaneConfig(chunk_bytes=1 << 20, edge_bytes=0)
    receiver._slack, receiver._ordinals = set(), collections.OrderedDict()
    mib = 1 << 20
    items = [RecvItem(tid, i, mib, torch.empty(0)) for tid, n in (("t", 4), ("u", 2)) for i in range(n)]
    receiver.add_items(items)
    assert [c.transfer_id for c in receiver.unannounced] == list("ttttuu")
    assert receiver._slack == {0, 1}  # two more of "t" land after each; none of "u" has two after it
    assert {c.lane for c in receiver.unannounced} == {0}  # a one-lane offer


def _bare_receiver(lanes: int, **config: int) -> object:
    """A RecvChannel with only what ``add_items`` reads (a real one needs CUDA streams)."""
    import collections
    import threading

    from kvwire.transfer.planes.nccl.config import NcclPlaneConfig
    from kvwire.transfer.planes.nccl.plane_info import CommOffer
    from kvwire.transfer.planes.nccl.recv import RecvChannel

    receiver = object.__new__(RecvChannel)
    receiver.cond, receiver.next_seq = threading.Condition(), 0
    receiver.pending, receiver.unannounced = [], []
    receiver.offer = CommOffer("c", bytes(128), lane_ids=[bytes(128)] * (lanes - 1))
    receiver.config = NcclPlaneConfig(lanes=lanes, **config)
    receiver._slack, receiver._ordinals = set(), collections.OrderedDict()
    return receiver


def test_a_transfers_messages_take_turns_on_the_lanes_from_lane_0() -> None:
    import torch

    from kvwire.transfer.memory import RecvItem

    mib = 1 << 20
    receiver: Any = _bare_receiver(2, chunk_bytes=mib, edge_bytes=0)
    receiver.add_items([RecvItem("t", i, mib, torch.empty(0)) for i in range(3)])
    receiver.add_items([RecvItem("u", i, mib, torch.empty(0)) for i in range(2)])
    receiver.add_items([RecvItem("t", 3, mib, torch.empty(0))])  # "t" goes on where it left off
    plans = [(c.transfer_id, c.seq, c.lane) for c in receiver.unannounced]
    assert plans == [("t", 0, 0), ("t", 1, 1), ("t", 2, 0), ("u", 3, 0), ("u", 4, 1), ("t", 5, 1)]
    # the framing cuts the middle into a multiple of the lanes: 512 tokens of Llama-3-8B KV
    receiver = _bare_receiver(2, chunk_bytes=96 * mib, edge_bytes=8 * mib, ramp=4)
    receiver.add_items([RecvItem("v", i, 2 * mib, torch.empty(0)) for i in range(32)])
    assert [c.num_bytes // mib for c in receiver.unannounced] == [8, 24, 24, 8]
    assert [c.lane for c in receiver.unannounced] == [0, 1, 0, 1]
    one_lane: Any = _bare_receiver(1, chunk_bytes=96 * mib, edge_bytes=8 * mib, ramp=4)
    one_lane.add_items([RecvItem("v", i, 2 * mib, torch.empty(0)) for i in range(32)])
    assert [c.num_bytes // mib for c in one_lane.unannounced] == [8, 48, 8]
