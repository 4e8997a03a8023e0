"""A userspace TCP relay that injects network faults (this box has no netem and no iptables).

``FaultRelay(target_host, target_port)`` listens on 127.0.0.1 (``relay.port``) and forwards every
connection to the target. Its ``mode`` can change at any time and applies to traffic from then on:

* ``PASS``: forward both ways (with ``delay_s`` added per chunk and at most ``rate_bps`` bytes/s);
* ``BLACKHOLE``: a partition: connections stay open (no RST, no FIN) and nothing moves; bytes wait
  in the kernel's socket buffers (senders block once those are full) and flow again, in order, when
  the mode returns to ``PASS`` -- what TCP does across a partition shorter than its retransmission
  timeout. (Dropping bytes instead would corrupt the streams, which TCP never shows an application.)
* ``RESET``: reset every connection at once (SO_LINGER 0) and refuse nothing (new ones are reset too).

One thread per direction per connection; ``close()`` stops everything within a second.
:class:`RelayGroup` drives several relays (the ports of one link) as one.
"""

from __future__ import annotations

import contextlib
import enum
import socket
import struct
import threading
import time


class Mode(str, enum.Enum):
    PASS = "pass"
    BLACKHOLE = "blackhole"
    RESET = "reset"


class FaultRelay:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.mode = Mode.PASS
        self.delay_s = 0.0
        self.rate_bps = 0.0  # 0 = unlimited
        self.connections = 0
        self.bytes_forwarded = 0
        self._flowing = threading.Event()  # clear while BLACKHOLE: the pumps hold
        self._flowing.set()
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.port: int = self._server.getsockname()[1]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._accept_loop, name="relay-accept", daemon=True)
        self._accept.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_mode(self, mode: Mode) -> None:
        self.mode = mode
        if mode is Mode.BLACKHOLE:
            self._flowing.clear()
        else:
            self._flowing.set()
        if mode is Mode.RESET:
            with self._lock:
                socks, self._socks = self._socks, []
            for sock in socks:
                _reset(sock)

    def close(self) -> None:
        self._stop.set()
        self._flowing.set()
        self._accept.join(timeout=2)
        self._server.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for sock in socks:
            _reset(sock)
        for thread in self._threads:
            thread.join(timeout=2)

    def __enter__(self) -> FaultRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.mode is Mode.RESET:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                _reset(client)
                continue
            self.connections += 1
            with self._lock:
                self._socks += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                thread = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
                self._threads.append(thread)
                thread.start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.2)
        while self._hold():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data or not self._hold():  # a partition that began during recv holds this chunk too
                break
            if self.delay_s:
                time.sleep(self.delay_s)  # the injected latency
            if self.rate_bps:
                time.sleep(len(data) / self.rate_bps)  # the bandwidth cap
            try:
                dst.sendall(data)
            except OSError:
                break
            with self._lock:
                self.bytes_forwarded += len(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _hold(self) -> bool:
        """Wait while partitioned; False once the relay closes."""
        while not self._flowing.wait(0.2):
            if self._stop.is_set():
                return False
        return not self._stop.is_set()


class RelayGroup:
    """Several relays (e.g. the control and data ports of one P<->D link) switched together."""

    def __init__(self, relays: dict[str, FaultRelay]) -> None:
        self.relays = relays

    def __getitem__(self, name: str) -> FaultRelay:
        return self.relays[name]

    def set_mode(self, mode: Mode) -> None:
        for relay in self.relays.values():
            relay.set_mode(mode)

    def shape(self, *, delay_s: float = 0.0, rate_bps: float = 0.0) -> None:
        """Latency per chunk and bandwidth cap of every relay (0: none)."""
        for relay in self.relays.values():
            relay.delay_s, relay.rate_bps = delay_s, rate_bps

    def bytes_forwarded(self) -> int:
        return sum(relay.bytes_forwarded for relay in self.relays.values())

    def close(self) -> None:
        for relay in self.relays.values():
            relay.close()


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
