"""In-serving KV transfer throughput for ``kvwire bench serve``, beside the plane's ceiling on the
same bytes measured in the same run.

After a P/D setup's load, every instance's ``/kvwire/transfers`` lists its completed transfers:
bytes, seconds (sender: first layer handed to the plane -> last acknowledgement; receiver: first
layer landed -> last) and the sender's busy seconds (the time the plane held at least one of the
transfer's layers). With layer-wise sends the first two span part of P's forward; the busy time is
the wire's share, so ``wire`` GB/s (bytes / busy seconds) is what is compared with the ceiling: a
raw loopback socket moving the median transfer's bytes (CPU instances talk TCP on one host). GPU
setups report no ceiling here: ``kvwire bench transfer --backend nccl`` measures that one. Where a
plane copies on the GPU itself (CUDA IPC), the instances' ``kvwire_kv_device_copy_{bytes,seconds}``
counters give bytes over the copies' device windows, printed as ``device copies``: the mover's rate
when the GPU is otherwise idle; in serving on a shared GPU the windows also hold the time the copy
kernels wait for SMs that P's forward (and, without MPS, D's time slices) occupy.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvwire.cluster.local import http_json, http_text

Row = tuple[int, float, "float | None"]  # bytes, seconds, busy seconds
# Per instance URL, how many entries each list of its /kvwire/transfers held when the mark was taken
# (the lists are oldest first): what came after is the timed load's, the warm-up's before it.
Mark = dict[str, dict[str, int]]


def mark(urls: Iterable[str]) -> Mark:
    """The instances' transfer lists as they stand (taken after the warm-up requests)."""
    out: Mark = {}
    for url in urls:
        snapshot = _snapshot(url, None)
        if snapshot is not None:
            out[url] = {key: len(value) for key, value in snapshot.items() if isinstance(value, list)}
    return out


def _snapshot(url: str, since: Mark | None) -> dict[str, Any] | None:
    """An instance's /kvwire/transfers, each list without the entries that were there at ``since``
    (None when the instance cannot answer)."""
    try:
        snapshot = http_json(f"{url.rstrip('/')}/kvwire/transfers", timeout_s=5.0)
    except (OSError, ValueError):
        return None
    if not isinstance(snapshot, dict):
        return None
    skip = (since or {}).get(url, {})
    return {key: value[skip.get(key, 0):] if isinstance(value, list) else value
            for key, value in snapshot.items()}


def collect(urls: Iterable[str], since: Mark | None = None) -> dict[str, list[Row]]:
    """Every instance's completed transfers (after ``since``), per side (instances that cannot answer
    are skipped)."""
    rows: dict[str, list[Row]] = {"send": [], "recv": []}
    for url in urls:
        snapshot = _snapshot(url, since)
        if snapshot is None:
            continue
        for side in rows:
            for entry in snapshot.get(side, []):
                num_bytes, seconds, busy = [*list(entry), None][:3]
                if seconds and seconds > 0:
                    rows[side].append((int(num_bytes), float(seconds), None if busy is None else float(busy)))
    return rows


def exposed_handover(
    urls: Iterable[str], ttft_s: Sequence[float], since: Mark | None = None
) -> dict[str, Any]:
    """The exposed handover per request — P's forward end (its last KV layer written) -> D holds
    every layer — from the decode instances' ``/kvwire/transfers`` (``exposed``, one per transfer
    after ``since``, both clocks on one host), p50/p99 in seconds and as a share of the run's TTFT
    p50/p99 (the percentiles are of separate samples: requests are not joined one by one). The same
    for ``exposed_to_step`` (``to_step_*``): up to D's engine step that picks the transfer up, which
    adds the wait for D's next step boundary."""
    found: dict[str, list[float]] = {"exposed": [], "exposed_to_step": []}
    for url in urls:
        snapshot = _snapshot(url, since)
        if snapshot is None:
            continue
        for key, values in found.items():
            values += [float(v) for v in snapshot.get(key, []) if isinstance(v, (int, float))]
    exposed = found["exposed"]
    if not exposed:
        return {"count": 0}
    out: dict[str, Any] = {"count": len(exposed)}
    for prefix, values in (("", exposed), ("to_step_", found["exposed_to_step"])):
        if not values:
            continue
        out[f"{prefix}p50_s"], out[f"{prefix}p99_s"] = _pct(values, 0.5), _pct(values, 0.99)
        if ttft_s:
            out[f"{prefix}share_of_ttft_p50"] = out[f"{prefix}p50_s"] / _pct(ttft_s, 0.5)
            out[f"{prefix}share_of_ttft_p99"] = out[f"{prefix}p99_s"] / _pct(ttft_s, 0.99)
    return out


def describe_handover(summary: dict[str, Any]) -> str:
    """One line for the table."""
    if not summary.get("count"):
        return "exposed handover: none recorded"
    text = (f"exposed handover (P's forward end -> D holds every layer) x{summary['count']}: "
            f"p50 {summary['p50_s'] * 1e3:.2f} ms, p99 {summary['p99_s'] * 1e3:.2f} ms")
    if "share_of_ttft_p50" in summary:
        text += (f"; of TTFT p50 {summary['share_of_ttft_p50'] * 100:.1f} %, "
                 f"p99 {summary['share_of_ttft_p99'] * 100:.1f} %")
    if "to_step_p50_s" in summary:
        text += (f"; to D's next engine step p50 {summary['to_step_p50_s'] * 1e3:.2f} ms, "
                 f"p99 {summary['to_step_p99_s'] * 1e3:.2f} ms")
    return text


_DEVICE_COPY = {"kvwire_kv_device_copy_bytes": 0, "kvwire_kv_device_copy_seconds": 1}


def device_copies(urls: Iterable[str]) -> tuple[float, float]:
    """(bytes, seconds) the instances' planes copied on the GPU, summed from their ``/metrics``
    (instances that cannot answer are skipped)."""
    totals = [0.0, 0.0]
    for url in urls:
        try:
            families = list(text_string_to_metric_families(http_text(f"{url.rstrip('/')}/metrics", 5.0)))
        except (OSError, ValueError):
            continue
        for family in families:  # a counter's family (typed) or its _total series (untyped)
            slot = _DEVICE_COPY.get(family.name.removesuffix("_total"))
            if slot is not None:
                totals[slot] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals[0], totals[1]


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {"p50": _pct(values, 0.5), "p90": _pct(values, 0.9)}


def summarize(
    rows: dict[str, list[Row]], with_ceiling: bool, device_copy: tuple[float, float] = (0.0, 0.0)
) -> dict[str, Any]:
    """GB/s p50/p90 (end to end per side, and the sender's wire GB/s), the median transfer's bytes and
    (CPU) the raw-socket ceiling for them, with the wire p50's ratio to it; ``device_copy``: (bytes,
    seconds) from :func:`device_copies`, reported as one rate when any."""
    out: dict[str, Any] = {"count": len(rows["send"]) or len(rows["recv"])}
    if device_copy[0] > 0 and device_copy[1] > 0:
        out["device_copy_gbps"] = device_copy[0] / device_copy[1] / 1e9
    for side in ("send", "recv"):
        if rows[side]:
            out[f"{side}_gbps"] = _stats([b / s / 1e9 for b, s, _ in rows[side]])
    wire = [b / busy / 1e9 for b, _, busy in rows["send"] if busy]
    if wire:
        out["wire_gbps"] = _stats(wire)
    sizes = [b for b, _, _ in rows["recv"] or rows["send"]]
    if not sizes:
        return out
    out["median_bytes"] = int(statistics.median(sizes))
    if with_ceiling and out["median_bytes"] > 0:
        out["ceiling_gbps"] = socket_ceiling_gbps(out["median_bytes"])
        if wire:
            out["wire_ratio_p50"] = out["wire_gbps"]["p50"] / out["ceiling_gbps"]
    return out


def socket_ceiling_gbps(num_bytes: int, repeats: int = 5) -> float:
    """Best of ``repeats`` raw loopback sends of ``num_bytes`` (sendall -> recv_into), GB/s."""
    import torch

    from kvwire.bench.transfer import _ceiling_once
    from kvwire.transfer.config import TransferConfig

    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    buffer_bytes = TransferConfig().socket_buffer_bytes
    best = min(_ceiling_once(src, dst, buffer_bytes) for _ in range(repeats))
    return num_bytes / best / 1e9


def describe(summary: dict[str, Any]) -> str:
    """One line for the table."""
    if not summary.get("count"):
        return "in-serving KV transfer: none recorded"

    def fmt(key: str) -> str:
        s = summary.get(key)
        return "-" if s is None else f"{s['p50']:.2f}/{s['p90']:.2f}"

    mib = summary.get("median_bytes", 0) / 2**20
    text = (
        f"in-serving KV transfer x{summary['count']} ({mib:.1f} MiB median), GB/s p50/p90: "
        f"wire {fmt('wire_gbps')}, send {fmt('send_gbps')}, recv {fmt('recv_gbps')}"
    )
    if "ceiling_gbps" in summary:
        text += f"; ceiling {summary['ceiling_gbps']:.2f}"
        if "wire_ratio_p50" in summary:
            text += f", wire p50 / ceiling {summary['wire_ratio_p50']:.2f}"
    if "device_copy_gbps" in summary:
        text += f"; device copies {summary['device_copy_gbps']:.0f} GB/s (bytes / copy windows on the GPU)"
    return text
