"""What the same-host planes (``shm``, ``ipc``) share on top of the listener lifecycle
(:class:`~kvwire.transfer.planes.common.listener.ListenerPlane`): a Linux abstract Unix socket that
peers connect to, a peer named by its process for the per-peer cap, and the table of destinations a
peer granted. Each plane supplies its link classes (:meth:`UnixLinkPlane._inbound_link`) and what it
cleans up on close.

The listener is bounded like the TCP plane's (:mod:`~kvwire.transfer.planes.common.admission`:
connections per listener and per peer process, the handshake deadline, back-off on EMFILE) and its
acceptor is supervised. After the hello every link's socket keeps a timeout,
``links.link_timeout_s``: a write to a peer that stops reading fails after that long without
progress. Readers treat a read timeout as an idle moment (a dead peer shows as EOF: its descriptors
close with its process).
"""

from __future__ import annotations

import secrets
import socket
import threading
from typing import TypeVar

from kvwire.transfer.planes.common.admission import unix_peer
from kvwire.transfer.planes.common.listener import ListenerPlane, OutT
from kvwire.transfer.planes.common.wire import abstract_name

_Dest = TypeVar("_Dest")


def take_granted(
    lock: threading.Lock, table: dict[tuple[str, int], tuple[str, _Dest]], peer_id: str, key: tuple[str, int]
) -> _Dest | None:
    """Remove and return the destination a peer granted for ``key`` (transfer id, layer): None when
    there is none or another peer granted it (the sender then uses its fallback or fails the layer)."""
    with lock:
        entry = table.get(key)
        if entry is None or entry[0] != peer_id:
            return None
        del table[key]
    return entry[1]


class UnixLinkPlane(ListenerPlane[OutT]):
    """Base of the planes whose links are abstract Unix sockets (one network namespace, one host)."""

    def _open_listener(self) -> tuple[socket.socket, str]:
        address = f"@kvwire-{self.link_kind}-{self.instance_id}-{secrets.token_hex(4)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(abstract_name(address))
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        return listener, address

    def _peer(self, conn: socket.socket, addr: object) -> str:
        return unix_peer(conn, addr)
