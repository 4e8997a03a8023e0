"""An instance registers only once its HTTP server answers (``wait_for_http``: the vLLM plugin)."""

from __future__ import annotations

import http.server
import threading

import zmq

from kvwire.discovery import Heartbeat, HeartbeatClient, InstanceInfo, decode_frames
from kvwire.protocol.kv_params import Role
from support.waiting import free_port as _free_port


def test_first_heartbeat_waits_for_the_http_server() -> None:
    http_port = _free_port()
    info = InstanceInfo(instance_id="d0", role=Role.DECODE, url=f"http://127.0.0.1:{http_port}",
                        model="m")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    client = HeartbeatClient(f"tcp://127.0.0.1:{port}", info, interval_s=0.05, wait_for_http=True).start()
    server: http.server.HTTPServer | None = None
    try:
        assert not sock.poll(600), "registered before the HTTP server listened"
        server = http.server.HTTPServer(("127.0.0.1", http_port), http.server.BaseHTTPRequestHandler)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        assert sock.poll(5000), "no heartbeat after the HTTP server started answering"
        msg = decode_frames(sock.recv_multipart())
        assert isinstance(msg, Heartbeat) and msg.info.instance_id == "d0"
    finally:
        client.close()
        if server is not None:
            server.shutdown()
            server.server_close()
        sock.close()
        ctx.term()


def test_closing_before_the_server_answers_sends_nothing() -> None:
    info = InstanceInfo(instance_id="d1", role=Role.DECODE, url=f"http://127.0.0.1:{_free_port()}",
                        model="m")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    client = HeartbeatClient(f"tcp://127.0.0.1:{port}", info, interval_s=0.05, wait_for_http=True).start()
    try:
        client.close()
        assert client._thread is not None and not client._thread.is_alive()
        assert not sock.poll(300)  # neither a heartbeat nor a deregistration
    finally:
        sock.close()
        ctx.term()


def test_every_router_gets_every_heartbeat() -> None:
    """Router high availability: one instance registers with two routers (``--router`` repeated)."""
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.PULL) for _ in range(2)]
    ports = []
    for sock in socks:
        sock.setsockopt(zmq.LINGER, 0)
        ports.append(sock.bind_to_random_port("tcp://127.0.0.1"))
    info = InstanceInfo(instance_id="p9", role=Role.PREFILL, url="http://127.0.0.1:1", model="m")
    address = ",".join(f"tcp://127.0.0.1:{p}" for p in ports)
    client = HeartbeatClient(address, info, interval_s=0.05).start()
    try:
        for sock in socks:
            seqs = []
            for _ in range(3):
                assert sock.poll(5000)
                msg = decode_frames(sock.recv_multipart())
                assert isinstance(msg, Heartbeat)
                seqs.append(msg.seq)
            assert seqs == sorted(seqs) and len(set(seqs)) == 3 and seqs[1] == seqs[0] + 1  # none skipped
    finally:
        client.close()
        for sock in socks:
            sock.close()
        ctx.term()
