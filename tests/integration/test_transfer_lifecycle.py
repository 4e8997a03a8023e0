"""Shared secret enforcement and clean shutdown (no thread or socket left after close)."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time

import torch

from kvwire.transfer import LayerSpec, TransferAgent, TransferConfig
from support.transfer_helpers import has_all, plane_address, poll_until, shm_rings_mapped

LAYERS = [torch.arange(64, dtype=torch.float32).reshape(4, 16) + i for i in range(3)]


def _push(sender: TransferAgent, receiver: TransferAgent, tid: str, deadline_s: float = 10.0) -> None:
    receiver.expect(tid, num_layers=len(LAYERS), deadline_s=deadline_s)
    sender.start_send(tid, receiver.endpoint, [LayerSpec.of(t) for t in LAYERS], deadline_s=deadline_s)
    for i, t in enumerate(LAYERS):
        sender.send_layer(tid, i, t)


def test_secret_is_required_on_control_and_data_planes() -> None:
    secret = TransferConfig(secret=b"s3cret")
    with (
        TransferAgent(secret) as guarded,
        TransferAgent(secret) as friend,
        TransferAgent(TransferConfig()) as stranger,
        TransferAgent(TransferConfig(secret=b"wrong")) as impostor,
    ):
        _push(friend, guarded, "ok")
        poll_until(guarded, has_all("recvd", ["ok"]), timeout_s=10)
        assert torch.equal(guarded.take_layers("ok")[2], LAYERS[2])
        _push(stranger, guarded, "no-secret", deadline_s=1.0)
        _push(impostor, guarded, "bad-secret", deadline_s=1.0)
        for agent in (stranger, impostor):
            events = poll_until(agent, lambda ev: bool(ev["failed"]), timeout_s=10)
            assert next(iter(events["failed"].values())).startswith("deadline")
        events = poll_until(guarded, has_all("failed", ["no-secret", "bad-secret"]), timeout_s=10)
        assert all(r.startswith("deadline: no offer") for r in events["failed"].values())
        assert guarded.stats().bytes_received == sum(t.numel() * 4 for t in LAYERS)  # only the friend's
        rejected = guarded.stats().messages_rejected
        assert rejected >= 2
        # data plane: a connection whose hello carries no valid MAC is closed
        host, port = plane_address(guarded, "tcp").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.recv(16)
            me = b"intruder"
            raw.sendall(struct.pack("!4sBH", b"KVWD", 1, len(me)) + me + bytes(32))
            with contextlib.suppress(ConnectionResetError):
                assert raw.recv(1) == b""
        # ... and so is one on the shared-memory plane's socket (before any ring is handed out)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(5)
            raw.connect("\0" + plane_address(guarded, "shm")[1:])
            raw.recv(16)
            raw.sendall(struct.pack("!4sBH", b"KVWS", 1, len(me)) + me + bytes(32))
            with contextlib.suppress(ConnectionResetError):
                assert raw.recv(1) == b""
        deadline = time.monotonic() + 10
        while guarded.stats().messages_rejected <= rejected + 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_close_leaves_no_thread_or_socket() -> None:
    threads_before = set(threading.enumerate())
    fds_before = _open_fds()
    rings_before = shm_rings_mapped()
    a = TransferAgent(TransferConfig())
    b = TransferAgent(TransferConfig())
    _push(a, b, "one")
    _push(b, a, "two")
    poll_until(b, has_all("recvd", ["one"]), timeout_s=10)
    poll_until(a, has_all("recvd", ["two"]), timeout_s=10)
    assert shm_rings_mapped() == rings_before + 4  # both links, each mapped by both ends
    a.start_send("left-open", b.endpoint, [LayerSpec.of(LAYERS[0])])  # in flight at close
    assert len(set(threading.enumerate()) - threads_before) >= 6  # control + plane threads
    a.close()
    b.close()
    b.close()  # idempotent
    assert set(threading.enumerate()) == threads_before
    assert _open_fds() <= fds_before
    assert shm_rings_mapped() == rings_before and not any("kvwire" in n for n in os.listdir("/dev/shm"))
    assert "left-open" in a.poll().failed
