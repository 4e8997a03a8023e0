"""Captured sends: a run of one transfer's messages as one CUDA graph, replayed with one host call.

Launching a message from Python costs the sender 100-320 us (a Triton gather launch and an NCCL
group, each several times slower inside the agent than in a tight loop), which is more than a 64 MiB
message's wire time: the link idles between messages (decision 063). A graph replay costs one
``cudaGraphLaunch`` for the whole run, and every message's gather and send are already on the GPU.

What a graph bakes in is exactly what the Python path would enqueue for the same run, by address:
each message's byte count, source address and 8-byte "real" status send, and every device producer's
work (a producer is capturable when it names everything its work reads or writes in a
``capture_key``, see :class:`CapturableProducer`). The key is built from those, so a replay does
the same work as the Python path for *this* run; callers get hits by reusing their buffers (the
caching allocator hands the same addresses back for the same sizes).

Rules that keep it safe (each learnt the hard way, decision 064):

* capture on a side stream in thread-local mode, never with ``torch.cuda.graph`` (which synchronizes
  the device: that waits for posted NCCL receives, whose sender may be waiting for us);
* capture only on a connected channel, and only a key seen before (the Python path ran the same
  shape once: kernels are loaded, as a module load inside a capture would synchronize);
* producers are captured first, on their own stream, and NCCL calls after: a producer that raises
  aborts the capture before NCCL saw any call (an NCCL call captured and then dropped would put the
  two ends of the stream out of step);
* NCCL will not destroy or abort a communicator while a graph that captured it lives
  (``commDestroySync`` waits for them): :meth:`SendGraphs.close` resets every graph first, and the
  channel calls it before it aborts or destroys its communicator.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Hashable, Sequence

import torch

from kvwire.transfer.memory import DeviceProducer, SendItem

_MAX_SEEN = 1024  # keys remembered for the "seen before" rule


@dataclasses.dataclass(frozen=True)
class Captured:
    """A captured run: the graph, and the status words its sends read (``[magic, real]``)."""

    graph: torch.cuda.CUDAGraph
    status: torch.Tensor


class CaptureAborted(Exception):
    """A capture was given up before any NCCL call was captured (a producer raised, or the graph
    store closed meanwhile); the caller launches the run on the Python path instead."""


def producer_key(producer: DeviceProducer, items: Sequence[SendItem]) -> Hashable | None:
    """The producer's capture key for ``items``, or None when it cannot be captured."""
    capture_key = getattr(producer, "capture_key", None)
    if capture_key is None:
        return None
    try:
        key: Hashable | None = capture_key(items)
    except Exception:  # a buggy key method: not capturable; its call fails it on the Python path
        return None
    return key


class SendGraphs:
    """Captured graphs of one send channel (one communicator), least recently used first out."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.capacity = capacity
        self._lock = threading.Lock()
        self._graphs: collections.OrderedDict[Hashable, Captured] = collections.OrderedDict()
        self._seen: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._closed = False
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self.captures = 0
        self.replays = 0
        self.aborted = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._graphs)

    def find(self, key: Hashable, count: bool = True) -> tuple[Captured | None, bool]:
        """(the graph of ``key``, or None; whether the key was seen before: capture it now). A miss
        counts as a sighting of ``key`` unless ``count`` is false (a look that launches nothing)."""
        with self._lock:
            if self._closed or self.capacity == 0:
                return None, False
            graph = self._graphs.get(key)
            if graph is not None:
                self._graphs.move_to_end(key)
                return graph, False
            seen = key in self._seen
            if not count:
                return None, seen
            self._seen[key] = None
            self._seen.move_to_end(key)
            while len(self._seen) > _MAX_SEEN:
                self._seen.popitem(last=False)
            return None, seen

    def capture(
        self,
        key: Hashable,
        produce: Callable[[], list[torch.cuda.Event]],
        send: Callable[[torch.cuda.Stream, list[torch.cuda.Event]], None],
        status: torch.Tensor,
    ) -> Captured:
        """Capture ``produce`` (enqueues every producer on the current stream, returns one event per
        message marking its producers' end) then ``send`` (given the capture stream and those events,
        enqueues every message's NCCL group, each behind its event) into a graph stored under ``key``.

        Raises :class:`CaptureAborted` when ``produce`` raised or the store closed (nothing reached
        NCCL); an error raised by ``send`` propagates after the graph was destroyed."""
        capture_stream, produce_stream = self._capture_streams()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(capture_stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    produce_stream.wait_stream(capture_stream)
                    with torch.cuda.stream(produce_stream):
                        try:
                            events = produce()
                        except Exception as exc:
                            raise CaptureAborted(f"a producer raised during capture: {exc!r}") from exc
                    with self._lock:
                        closed = self._closed
                    if closed:
                        raise CaptureAborted("the channel closed during capture")
                    send(capture_stream, events)
                finally:
                    capture_stream.wait_stream(produce_stream)  # joined, or the capture is invalid
                    graph.capture_end()
        except BaseException:
            graph.reset()  # never left alive: it may hold the communicator (see close)
            with self._lock:
                self.aborted += 1
            raise
        with self._lock:
            if self._closed:
                graph.reset()
                raise CaptureAborted("the channel closed during capture")
            captured = Captured(graph, status)
            self._graphs[key] = captured
            self.captures += 1
            while len(self._graphs) > self.capacity:
                old_key, old = self._graphs.popitem(last=False)
                old.graph.reset()  # an in-flight replay finishes first (CUDA frees it on completion)
                self._seen.pop(old_key, None)  # must be seen again: no capture churn at capacity
        return captured

    def replay(self, captured: Captured) -> bool:
        """Launch the graph on the current stream; False (nothing launched) once closed."""
        with self._lock:  # close() never resets a graph between the check and the launch
            if self._closed:
                return False
            captured.graph.replay()
            self.replays += 1
        return True

    def close(self) -> None:
        """Destroy every graph (call before the communicator is aborted or destroyed: NCCL waits for
        the graphs that captured it). Replays in flight finish first; later ``find`` calls miss."""
        with self._lock:
            self._closed = True
            graphs = [c.graph for c in self._graphs.values()]
            self._graphs.clear()
        for graph in graphs:
            graph.reset()

    def _capture_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device=self.device), torch.cuda.Stream(device=self.device))
        return self._streams
