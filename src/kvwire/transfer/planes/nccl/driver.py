"""Drive two :class:`~kvwire.transfer.planes.nccl.plane.NcclPlane` s in two processes without the
agent: the plane's own contract exercised directly, for its GPU tests and for the plane-level
diagnostic of ``kvwire bench transfer --backend nccl`` (row (p)). It plays the agent's part (post
receive buffers, carry ``local_info`` bytes to the peer's ``on_peer_info`` with the "grant", hand
ready layers to ``send``) over a ``multiprocessing`` pipe and records the plane's callbacks. Serving
never uses it: serving goes through the agent (decision 068).
"""

from __future__ import annotations

import collections
import faulthandler
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvwire.errors import TransferTimeout
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.enums import Backend
from kvwire.transfer.memory import DeviceConsumer, PeerRef, RecvItem
from kvwire.transfer.planes.nccl.plane import NcclPlane, NcclPlaneConfig

log = logging.getLogger(__name__)


NCCL_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def set_safe_env() -> None:
    """NVLink multicast stays off on shared machines (see docs/decisions/061-nccl-data-plane.md)."""
    for key, value in NCCL_SAFE_ENV.items():
        os.environ.setdefault(key, value)


def child_results(queue: Any, count: int, timeout_s: float = 180.0) -> dict[str, Any]:
    """``count`` results of :func:`run_in_child` by function name; a child's exception raises here."""
    out = {}
    for _ in range(count):
        name, value, error = queue.get(timeout=timeout_s)
        if error is not None:
            raise AssertionError(f"{name} failed:\n{error}")
        out[name] = value
    return out


def run_in_child(fn: Callable[..., Any], rank: int, conn: Connection, queue: Any, arg: Any) -> None:
    """Process entry of a two-GPU scenario: run ``fn(conn, arg)`` on GPU ``rank``, report to ``queue``."""
    # SIGUSR1 prints every thread's stack to stderr (the GPU tests' teardown asks a hung child first)
    faulthandler.enable()  # a crash in native code (NCCL, CUDA) still leaves a Python stack
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    dump_s = float(os.environ.get("KVWIRE_CHILD_DUMP_S", "0"))  # debugging hangs: stacks after that
    if dump_s > 0:
        faulthandler.dump_traceback_later(dump_s)
    try:
        set_safe_env()
        torch.cuda.set_device(rank)
        queue.put((fn.__name__, fn(conn, arg), None))
    except BaseException:
        queue.put((fn.__name__, None, traceback.format_exc()))


def peer_ref(instance_id: str) -> PeerRef:
    return PeerRef(endpoint="tcp://127.0.0.1:1", instance_id=instance_id, data_address="")


class Recorder:
    """PlaneCallbacks that count per-transfer completions and keep failures; ``on_layer`` (if set)
    runs on the plane's completer thread for each received layer (e.g. a group scatter)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.sent: collections.Counter[str] = collections.Counter()
        self.received: collections.Counter[str] = collections.Counter()
        self.failed: dict[str, str] = {}
        self.peer_failed: dict[str, str] = {}
        self.protocol_errors: list[str] = []
        self.on_layer: Callable[[str, int], None] | None = None

    def on_sent(self, peer_instance_id: str, transfer_id: str, layer_indices: Sequence[int]) -> None:
        with self.cond:
            self.sent[transfer_id] += len(layer_indices)
            self.cond.notify_all()

    def on_received(self, peer_instance_id: str, transfer_id: str, layer_indices: Sequence[int]) -> None:
        if self.on_layer is not None:
            for index in layer_indices:
                self.on_layer(transfer_id, index)
        with self.cond:
            self.received[transfer_id] += len(layer_indices)
            self.cond.notify_all()

    def on_transfer_failed(self, transfer_id: str, reason: str) -> None:
        with self.cond:
            self.failed[transfer_id] = reason
            self.cond.notify_all()

    def on_peer_failed(self, peer_instance_id: str, reason: str) -> None:
        with self.cond:
            self.peer_failed[peer_instance_id] = reason
            self.cond.notify_all()

    def on_protocol_error(self, reason: str) -> None:
        with self.cond:
            self.protocol_errors.append(reason)

    def peer_endpoint(self, peer_instance_id: str) -> str | None:
        return peer_ref(peer_instance_id).endpoint  # the two ranks know each other

    def on_device_copy(self, num_bytes: int, seconds: float) -> None:
        pass  # the NCCL plane's time is measured by its driver's callers

    def wait_sent(self, transfer_id: str, count: int, timeout_s: float = 60.0) -> None:
        self.wait_for(lambda: self.sent[transfer_id] >= count, timeout_s)

    def wait_received(self, transfer_id: str, count: int, timeout_s: float = 60.0) -> None:
        self.wait_for(lambda: self.received[transfer_id] >= count, timeout_s)

    def wait_for(self, predicate: Callable[[], object], timeout_s: float) -> None:
        """Wait until ``predicate()`` (evaluated under the lock) holds; raise on timeout."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    log.error("harness wait timed out; Python stacks:\n%s", _thread_stacks())
                    raise TransferTimeout(
                        f"harness wait timed out; failed={self.failed} peers={self.peer_failed}"
                    )
                self.cond.wait(timeout=min(left, 0.5))


def start_plane(rank: int, instance_id: str, plane_config: NcclPlaneConfig) -> tuple[NcclPlane, Recorder]:
    config = TransferConfig(backend=Backend.NCCL, device=f"cuda:{rank}")
    plane = NcclPlane(config, instance_id, plane_config)
    recorder = Recorder()
    plane.start(recorder)
    return plane, recorder


def post_layers(
    plane: NcclPlane,
    peer: PeerRef,
    transfer_id: str,
    sizes: Sequence[int],
    flat: torch.Tensor,
    first_layer: int = 0,
    on_device: DeviceConsumer | None = None,
) -> bytes:
    """Post receives for consecutive layers whose bytes lie back to back in ``flat`` (with a device
    consumer, if given); return the handshake bytes the agent would put in the GRANT."""
    items, offset = [], 0
    for index, size in enumerate(sizes):
        dest = flat[offset : offset + size]
        items.append(RecvItem(transfer_id, first_layer + index, size, dest, on_device=on_device))
        offset += size
    plane.post_recv(peer, items)
    return plane.local_info(peer)


def zero_copy_slab(
    plane: NcclPlane, shape: Sequence[int], dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """A ``shape`` tensor of ``dtype`` in the plane's zero-copy memory (moved in place by NCCL, so a
    sender's run of messages from it can be captured; see ``NcclPlane.allocate_zero_copy``)."""
    flat = plane.allocate_zero_copy(math.prod(shape) * dtype.itemsize)
    return flat.view(dtype).view(tuple(shape))


def _thread_stacks() -> str:
    """Every Python thread's stack, for the harness's log line when a wait times out."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "".join(
        f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )
