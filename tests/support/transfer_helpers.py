"""Shared helpers for transfer-agent tests: deterministic layers, a peer agent in a child process.

The child (``transfer_peer.py``) runs one :class:`TransferAgent` and answers JSON-line commands on
stdin/stdout, so tests can kill it (-9) or restart it on the same port like a real peer process.
Layer contents derive from (seed, layer index), so both sides can check every byte.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PEER_SCRIPT = Path(__file__).with_name("transfer_peer.py")
REPO_SRC = Path(__file__).resolve().parents[2] / "src"


def make_layer(seed: int, index: int, shape: Sequence[int], dtype: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 10_007 + index)
    return (torch.randn(tuple(shape), generator=gen) * 100).to(DTYPES[dtype])


def digest(tensor: torch.Tensor) -> str:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def random_specs(rng: random.Random, max_layers: int = 6) -> list[tuple[list[int], str]]:
    """Random layer shapes/dtypes of one transfer (some tiny, some ~100 KiB, one may be empty)."""
    specs = []
    for _ in range(rng.randint(1, max_layers)):
        shape = [2, rng.randint(0, 6), rng.randint(1, 16), rng.choice([1, 8, 64])]
        specs.append((shape, rng.choice(list(DTYPES))))
    return specs


def expected_digests(seed: int, specs: Sequence[tuple[Sequence[int], str]]) -> dict[int, str]:
    return {i: digest(make_layer(seed, i, shape, dt)) for i, (shape, dt) in enumerate(specs)}


def poll_until(
    agent: Any, done: Callable[[dict[str, dict[str, str]]], bool], timeout_s: float
) -> dict[str, dict[str, str]]:
    """Poll ``agent`` (never sleeping as synchronization: polling a condition) until
    ``done(events)``; events = {"sent": {id: ""}, "recvd": {...}, "failed": {id: reason}}."""
    events: dict[str, dict[str, str]] = {"sent": {}, "recvd": {}, "failed": {}}
    deadline = time.monotonic() + timeout_s
    while True:
        ev = agent.poll()
        for key, ids in (("sent", ev.finished_sending), ("recvd", ev.finished_recving)):
            for tid in ids:
                assert tid not in events[key], f"{tid} reported twice"
                events[key][tid] = ""
        for tid, reason in ev.failed.items():
            assert tid not in events["failed"], f"{tid} failed twice"
            events["failed"][tid] = reason
        if done(events):
            return events
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s}s; events so far: {events}")
        time.sleep(0.005)


def has_all(key: str, ids: Sequence[str]) -> Callable[[dict[str, dict[str, str]]], bool]:
    return lambda ev: all(t in ev[key] for t in ids)


def plane_address(agent: Any, backend: str) -> str:
    """One member plane's address out of ``agent.data_address`` ("shm=@...,tcp=host:port")."""
    parts = dict(part.split("=", 1) for part in agent.data_address.split(","))
    return parts[backend]


def shm_rings_mapped() -> int:
    """Shared-memory plane rings mapped into this process (memfds: they have no /dev/shm name)."""
    with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
        return sum("kvwire-shm-ring" in line for line in f)


class PeerProcess:
    """A TransferAgent in a child process, driven by JSON-line RPC. Always ``kill()`` it."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=f"{REPO_SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        self._hello: dict[str, Any] | None = None  # read lazily: children start in parallel

    @property
    def endpoint(self) -> str:
        return str(self.hello()["endpoint"])

    @property
    def instance_id(self) -> str:
        return str(self.hello()["instance_id"])

    def hello(self) -> dict[str, Any]:
        if self._hello is None:
            self._hello = self._read(timeout_s=60)
        return self._hello

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                raise TimeoutError(f"peer process did not answer within {timeout_s}s")
        line = self.proc.stdout.readline()
        if not line:
            raise ConnectionError(f"peer process exited (rc={self.proc.poll()})")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"peer error: {reply['error']}")
        return reply

    def call(self, op: str, timeout_s: float = 30.0, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.hello()
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()

    def close(self) -> None:
        """Graceful: close the agent (threads/sockets) and exit."""
        if self.proc.poll() is None:
            with contextlib.suppress(ConnectionError, TimeoutError, BrokenPipeError):
                self.call("close", timeout_s=15)
        self.kill()
