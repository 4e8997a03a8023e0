"""How one transfer's layers become NCCL messages (the receiver's framing, announced in its chunk
plans; see decisions 063, 065 and 067): ``ramp up | balanced middle | ramp down``, the middle in a
multiple of the channel's lanes."""

from __future__ import annotations

from collections.abc import Sequence

from kvwire.transfer.memory import RecvItem


def plan_chunks(
    items: Sequence[RecvItem], max_bytes: int, edge_bytes: int = 0, ramp: int = 0, lanes: int = 1
) -> list[list[RecvItem]]:
    """Group consecutive layers of the same transfer into NCCL messages of at most ``max_bytes`` (a
    single larger layer is its own message); device and host destinations never share a message.
    Each run of one transfer is framed by :func:`message_ranges`."""
    groups: list[list[RecvItem]] = []
    for run in _runs(items):
        sizes = [item.num_bytes for item in run]
        for start, stop in message_ranges(sizes, max_bytes, edge_bytes, ramp, lanes):
            groups.append(list(run[start:stop]))
    return groups


def _runs(items: Sequence[RecvItem]) -> list[list[RecvItem]]:
    """Maximal runs of consecutive items of one transfer with the same destination device."""
    runs: list[list[RecvItem]] = []
    for item in items:
        current = runs[-1] if runs else None
        if (
            current is None
            or item.transfer_id != current[0].transfer_id
            or item.dest.device != current[0].dest.device
        ):
            runs.append([item])
        else:
            current.append(item)
    return runs


def message_ranges(
    sizes: Sequence[int], max_bytes: int, edge_bytes: int, ramp: int = 0, lanes: int = 1
) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges of the messages one transfer's consecutive layers of ``sizes``
    bytes become: ``ramp up | middle ... | ramp down``. A sender that gathers layer groups itself can
    align its gathers with them.

    * The first and the last message hold the fewest layers that reach ``edge_bytes``: the sender's
      gather of the first message and the receiver's scatter of the last are not overlapped with the
      wire, so they are kept short.
    * With ``ramp >= 2`` each next message (from either end inward) holds up to ``ramp`` times the
      bytes of the one before, until ``max_bytes``: the gather of message k+1 (and the scatter of
      message k-1) still hides behind message k's wire time, with fewer boundaries than edge-sized
      steps. ``ramp`` below the copy/wire speed ratio (~5 on H200) keeps the copies hidden.
    * The middle is cut into the fewest messages of at most ``max_bytes``, balanced in size (every
      message boundary costs the wire ~10 us, so no tiny remainder message). With edges and
      ``lanes > 1`` their number is rounded up to a multiple of ``lanes`` (when there are layers
      enough): messages take turns on the lanes and overlap in pairs, and one big middle message
      beside a small last one would land last, leaving its copy exposed (decision 067).

    ``edge_bytes=0``: no edges (and no ramp). Fewer than 4 edges' worth of bytes: no edges either (the
    extra boundaries would cost more than they hide)."""
    n = len(sizes)
    edge_bytes = min(edge_bytes, max_bytes)
    head: list[int] = []
    tail: list[int] = []
    total = sum(sizes)
    if edge_bytes > 0 and total >= 4 * edge_bytes:
        head = _ramp(sizes, edge_bytes, max_bytes, ramp, total // 2)
        tail = _ramp(sizes[sum(head) :][::-1], edge_bytes, max_bytes, ramp, total // 2)
        if sum(head) + sum(tail) >= n:
            head, tail = head[:1], tail[:1]
            if sum(head) + sum(tail) >= n:
                head = tail = []
    out: list[tuple[int, int]] = []
    start = 0
    for length in head:
        out.append((start, start + length))
        start += length
    multiple = lanes if head else 1
    for length in _balanced(sizes[start : n - sum(tail)], max_bytes, multiple):
        out.append((start, start + length))
        start += length
    for length in reversed(tail):
        out.append((start, start + length))
        start += length
    return out


def _ramp(sizes: Sequence[int], edge_bytes: int, max_bytes: int, ramp: int, budget: int) -> list[int]:
    """Lengths of the ramp messages from the front of ``sizes``: the first reaches ``edge_bytes``, each
    next ``ramp`` times the bytes of the one before, while below ``max_bytes`` and within ``budget``
    bytes in all (at least the first message)."""
    lengths: list[int] = []
    goal, used, index = edge_bytes, 0, 0
    while goal < max_bytes and index < len(sizes):
        length = _reach(sizes[index:], goal)
        got = sum(sizes[index : index + length])
        if lengths and used + got > budget:
            break
        lengths.append(length)
        used += got
        index += length
        if ramp < 2:
            break
        goal = ramp * got
    return lengths


def _reach(sizes: Sequence[int], goal: int) -> int:
    """The fewest leading sizes (at least one) whose sum reaches ``goal``."""
    total = 0
    for count, size in enumerate(sizes, 1):
        total += size
        if total >= goal:
            return count
    return len(sizes)


def _balanced(sizes: Sequence[int], max_bytes: int, multiple: int = 1) -> list[int]:
    """Lengths of consecutive groups of at most ``max_bytes`` each (a larger single size is a group of
    its own), as few as the bound allows (rounded up to a multiple of ``multiple``, at most one
    group per size) and balanced: a group ends before the running sum would pass the next
    ``k/count`` mark of the total."""
    if not sizes:
        return []
    total = sum(sizes)
    count = max(1, -(-total // max_bytes))
    count = min(len(sizes), -(-count // multiple) * multiple) if multiple > 1 else count
    share = total / max(count, 1)
    lengths: list[int] = []
    length = group = done = 0
    for size in sizes:
        overshoots = done + group + size > share * (len(lengths) + 1) + 0.5
        if length and (group + size > max_bytes or overshoots):
            lengths.append(length)
            done += group
            length = group = 0
        length += 1
        group += size
    lengths.append(length)
    return lengths
