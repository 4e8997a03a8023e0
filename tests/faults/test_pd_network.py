"""Network faults between P and D, through userspace relays (tests/support/fault_relay.py).

P and D each listen on fixed KV ports and advertise a relay's ports instead (``--kv-advertise-port``,
``--kv-advertise-data-port``; decision 090), so every P<->D byte -- control messages both ways and
the KV data -- crosses the relays, while router<->instance traffic goes direct. The data plane is
forced to TCP: on one host P and D would negotiate the shared-memory plane (planes/negotiation.py
prefers it), whose memfd ring never touches a socket a relay could sit on.

Each fault -- a partition (blackhole) held for the whole request, connection resets, 0.3 s latency
per chunk, a bandwidth cap that makes the transfer outlast ``--kv-deadline-s`` -- is checked for:
every request ends OK within its bound (none hangs), ``kvwire_kv_blocks_in_use`` back to 0, P and D
back to their thread / fd / shared-memory baseline (tests/support/leaks.py), and, healed, the link
carries KV again.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvwire.cluster.local import ClusterSpec, LocalCluster
from support.fault_cluster import blocks_back_to_zero, completion, http_ports, metric, post_json
from support.fault_relay import FaultRelay, Mode, RelayGroup
from support.leaks import LeakBaseline
from support.sse_client import stream
from support.waiting import free_port

pytestmark = pytest.mark.slow
KV_DEADLINE_S = 3.0
MAX_TOKENS = 8
BOUND_S = KV_DEADLINE_S + 20.0  # lease expiry + recompute + a loaded 2-core box
RECV_DONE = "kvwire_pd_transfers_completed_total"
LOAD_FAILED = "kvwire_pd_load_failures_total"
PORT_NAMES: dict[int, str] = {}  # named in leak reports


@dataclass
class Link:
    cluster: LocalCluster
    relays: RelayGroup
    baseline: LeakBaseline
    prompts: int = 0

    def url(self, name: str) -> str:
        url = self.cluster.instances[name].url
        assert url is not None
        return url

    def prompt(self) -> list[int]:
        """A prompt no instance saw before (no prefix-cache hit stands in for the transfer)."""
        self.prompts += 1
        return [(self.prompts * 31 + 7 * j) % 250 + 1 for j in range(40)]


def _relayed_args(relays: dict[str, FaultRelay], name: str) -> tuple[str, ...]:
    control, data = free_port(), free_port()
    PORT_NAMES.update({control: f"{name} kv", data: f"{name} data"})
    relays[f"{name}-control"] = FaultRelay("127.0.0.1", control)
    relays[f"{name}-data"] = FaultRelay("127.0.0.1", data)
    return ("--kv-port", str(control), "--kv-data-port", str(data),
            "--kv-advertise-port", str(relays[f"{name}-control"].port),
            "--kv-advertise-data-port", str(relays[f"{name}-data"].port))


@pytest.fixture(scope="module")
def link(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Link]:
    spec = ClusterSpec(kv_transport="tcp", kv_deadline_s=KV_DEADLINE_S,  # type: ignore[arg-type]
                       heartbeat_interval_s=0.5, instance_ttl_s=3.0)
    relays: dict[str, FaultRelay] = {}
    log = Path(tmp_path_factory.mktemp("pdnet")) / "pdnet.log"
    with open(log, "w") as sink, contextlib.ExitStack() as stack:
        cluster = LocalCluster(spec, sink=sink)
        stack.callback(lambda: [relay.close() for relay in relays.values()])
        stack.callback(cluster.stop)
        cluster.start_router()
        cluster.start_instance("prefill-0", "prefill", _relayed_args(relays, "p"))  # type: ignore[arg-type]
        cluster.start_instance("decode-0", "decode", _relayed_args(relays, "d"))  # type: ignore[arg-type]
        cluster.wait_ready()
        group = RelayGroup(relays)
        state = Link(cluster, group, LeakBaseline({}, {}, frozenset()))
        # Warm every path up before the baseline: lazy threads, and the router's keep-alive pool to
        # each instance grown to the faults' concurrency (two requests at once).
        _carries_kv(state)
        _requests_during(state)
        instances = cluster.instances.items()
        pids = {name: inst.process.pid for name, inst in instances}
        http = {int(str(inst.url).rsplit(":", 1)[1]): f"{name} http" for name, inst in instances}
        PORT_NAMES.update(http)
        PORT_NAMES.update({r.port: f"relay {k}" for k, r in relays.items()})
        # the router's keep-alive pool to each instance grows with the load's concurrency: not counted
        state.baseline = LeakBaseline.take(pids, PORT_NAMES, pooled_ports=http_ports(cluster))
        yield state


def _carries_kv(link: Link) -> None:
    """One request through the router whose KV crosses the relays (D received it, nothing recomputed)."""
    d_url = link.url("decode-0")
    done, failed, moved = metric(d_url, RECV_DONE), metric(d_url, LOAD_FAILED), link.relays.bytes_forwarded()
    status, answer = post_json(link.cluster.router_url + "/v1/completions",
                               completion(MAX_TOKENS, stream=False, prompt=link.prompt()))
    assert status == 200 and len(answer["choices"][0]["token_ids"]) == MAX_TOKENS, answer
    assert metric(d_url, RECV_DONE) == done + 1 and metric(d_url, LOAD_FAILED) == failed
    assert link.relays.bytes_forwarded() - moved > 40 * 2048  # the prompt's KV (2 KiB a token) went through


@dataclass
class Outcome:
    kind: str
    status: int
    tokens: int
    error: str
    elapsed_s: float


def _one(link: Link, streaming: bool, out: list[Outcome]) -> None:
    body = completion(MAX_TOKENS, stream=streaming, prompt=link.prompt())
    start = time.monotonic()
    if streaming:
        got = stream(link.cluster.router_url, "/v1/completions", body, timeout_s=BOUND_S + 30)
        error = got.error or "; ".join(str(e) for e in got.errors)
        out.append(Outcome("stream", got.status, len(got.token_ids()), error, time.monotonic() - start))
        return
    status, answer = post_json(link.cluster.router_url + "/v1/completions", body, timeout_s=BOUND_S + 30)
    tokens = len(answer["choices"][0]["token_ids"]) if status == 200 else 0
    out.append(Outcome("plain", status, tokens, "" if status == 200 else str(answer),
                       time.monotonic() - start))


def _requests_during(link: Link) -> list[Outcome]:
    """A streaming and a non-streaming request at once; every one must end OK within BOUND_S."""
    out: list[Outcome] = []
    threads = [threading.Thread(target=_one, args=(link, s, out), daemon=True) for s in (True, False)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND_S + 60)
    assert len(out) == 2, f"a request hung: {out}"
    for outcome in out:
        assert outcome.status == 200 and outcome.tokens == MAX_TOKENS and not outcome.error, outcome
        assert outcome.elapsed_s < BOUND_S, outcome
    return out


def _recovered(link: Link) -> None:
    assert blocks_back_to_zero(link.cluster, 15)
    link.baseline.wait_back(20)
    _carries_kv(link)  # healed: KV crosses the link again, no restart needed
    assert not link.cluster.check()


@pytest.mark.parametrize("fault", [Mode.BLACKHOLE, Mode.RESET])
def test_partition_and_reset_fall_back_to_recompute(link: Link, fault: Mode) -> None:
    """Cut the link for the whole requests: D's lease on P's transfer expires (P is silent) and D
    recomputes the prompt (the default policy); no request fails or hangs."""
    failed = metric(link.url("decode-0"), LOAD_FAILED)
    link.relays.set_mode(fault)
    try:
        outcomes = _requests_during(link)
    finally:
        link.relays.set_mode(Mode.PASS)
    assert metric(link.url("decode-0"), LOAD_FAILED) >= failed + 2  # each load failed, then recomputed
    print({o.kind: round(o.elapsed_s, 2) for o in outcomes})
    _recovered(link)


@pytest.mark.parametrize("shape", [{"delay_s": 0.3}, {"rate_bps": 32_000.0}], ids=["delay", "bandwidth"])
def test_slow_link_still_carries_the_kv(link: Link, shape: dict[str, float]) -> None:
    """Latency, or a cap under which the KV (96 KiB a request, both on one connection) takes longer
    than the 3 s ``--kv-deadline-s``: the transfers stay alive on their renewed leases and complete;
    nothing is recomputed."""
    d_url = link.url("decode-0")
    done, failed = metric(d_url, RECV_DONE), metric(d_url, LOAD_FAILED)
    link.relays.shape(**shape)
    try:
        outcomes = _requests_during(link)
    finally:
        link.relays.shape()
    assert metric(d_url, LOAD_FAILED) == failed
    assert metric(d_url, RECV_DONE) == done + 2
    if "rate_bps" in shape:  # the capped link did hold a transfer past the fixed deadline
        assert max(o.elapsed_s for o in outcomes) > KV_DEADLINE_S
    print({o.kind: round(o.elapsed_s, 2) for o in outcomes})
    _recovered(link)
