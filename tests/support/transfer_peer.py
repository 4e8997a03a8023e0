"""Child process for transfer tests: one TransferAgent driven by JSON lines on stdin (see
transfer_helpers.PeerProcess). Replies one JSON line per command on stdout; logs go to stderr."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from transfer_helpers import DTYPES, digest, make_layer

from kvwire.transfer import LayerSpec, TransferAgent, TransferConfig
from kvwire.transfer.enums import Backend, KVLayout
from kvwire.transfer.memory import BlockTarget, shared_tensors
from kvwire.transfer.planes.base import PlaneSet
from kvwire.transfer.planes.common.link_config import DataLinkConfig
from kvwire.transfer.planes.shm.plane import ShmPlane
from kvwire.transfer.planes.shm.send import lock_slot


class Peer:
    def __init__(self, agent: TransferAgent) -> None:
        self.agent = agent
        self.events: dict[str, dict[str, str]] = {"sent": {}, "recvd": {}, "failed": {}}
        self.sink_digests: dict[str, dict[int, str]] = {}
        self.lock = threading.Lock()
        self.caches: list[torch.Tensor] = []  # registered by op_expect_blocks
        self.attack_stop = threading.Event()  # op_attack_grants runs until set

    def _poll(self) -> None:
        ev = self.agent.poll()
        for tid in ev.finished_sending:
            self.events["sent"][tid] = ""
        for tid in ev.finished_recving:
            self.events["recvd"][tid] = ""
        self.events["failed"].update(ev.failed)

    def op_send(
        self, tid: str, peer: str | None, seed: int, specs: list[Any], order: list[int], **kw: Any
    ) -> Any:
        layer_specs = [LayerSpec(tuple(shape), DTYPES[dt]) for shape, dt in specs]
        self.agent.start_send(
            tid,
            peer,
            layer_specs,
            deadline_s=kw.get("deadline_s"),
            with_trailer=kw.get("trailer") is not None,
            pull_by=kw.get("pull_by"),
        )
        self.op_send_more(tid, seed, specs, order)
        if kw.get("trailer") is not None:
            self.agent.send_trailer(tid, kw["trailer"].encode())
        return {}

    def op_send_blocks(
        self, tid: str, peer: str, seed: int, shape: list[int], num_layers: int, block_ids: list[int],
        layers: list[int],
    ) -> Any:
        """Register ``num_layers`` random caches of ``shape`` (KV_FIRST, seeded), announce a transfer
        of ``block_ids`` and hand over only ``layers`` of it (the serving path)."""
        gen = torch.Generator().manual_seed(seed)
        caches = [torch.randn(shape, generator=gen) for _ in range(num_layers)]
        self.agent.register_kv_caches(caches, KVLayout.KV_FIRST)
        self.agent.start_send(tid, peer, self.agent.block_layers(len(block_ids)))
        ids = torch.tensor(block_ids, dtype=torch.int64)
        for index in layers:
            self.agent.send_blocks(tid, index, ids)
        return {}

    def op_send_more(self, tid: str, seed: int, specs: list[Any], order: list[int]) -> Any:
        for i in order:
            shape, dt = specs[i]
            self.agent.send_layer(tid, i, make_layer(seed, i, shape, dt))
        return {}

    def op_expect(self, tid: str, num_layers: int, sink: bool = False, **kw: Any) -> Any:
        fn = None
        if sink:
            self.sink_digests[tid] = {}

            def fn(index: int, tensor: torch.Tensor) -> None:
                with self.lock:
                    self.sink_digests[tid][index] = digest(tensor)

        self.agent.expect(
            tid,
            num_layers=num_layers,
            sink=fn,
            deadline_s=kw.get("deadline_s"),
            pull_from=kw.get("pull_from"),
        )
        return {}

    def op_expect_blocks(
        self, tid: str, shape: list[int], num_layers: int, block_ids: list[int], shared: bool = True,
        deadline_s: float | None = None,
    ) -> Any:
        """Receive into ``block_ids`` of registered KV caches (KV_FIRST, float32, zeroed; made on
        first use), in shared memory as the built-in engine allocates them, or ordinary memory."""
        if not self.caches:
            if shared:
                self.caches = shared_tensors([shape] * num_layers, torch.float32)
            else:
                self.caches = [torch.zeros(shape) for _ in range(num_layers)]
            self.agent.register_kv_caches(self.caches, KVLayout.KV_FIRST)
        self.agent.expect(tid, num_layers=num_layers, into_blocks=BlockTarget(tuple(block_ids)),
                          deadline_s=deadline_s)
        return {}

    def op_block_digests(self, block_ids: list[int]) -> Any:
        ids = torch.tensor(block_ids, dtype=torch.int64)
        return {"digests": [digest(c.index_select(1, ids)) for c in self.caches]}

    def op_paths(self) -> Any:
        """Layers the shared-memory plane sent, by path (one_copy / ring)."""
        planes = self.agent._planes
        plane = planes.members[Backend.SHM] if isinstance(planes, PlaneSet) else None
        return {"paths": dict(plane.layers_sent) if isinstance(plane, ShmPlane) else {}}

    def op_attack_grants(self) -> Any:
        """Turn hostile (an authenticated peer attacking other peers' grants): with the grant table
        of every shared-memory link this agent holds, take every slot's lock and keep zeroing every
        token (a stop or a revoke of whatever grant the table carries) until ``stop_attack``."""
        planes = self.agent._planes
        plane = planes.members[Backend.SHM] if isinstance(planes, PlaneSet) else None
        assert isinstance(plane, ShmPlane)
        views = [out._grants for out in plane.outbound.values() if out._grants is not None]
        held = sum(lock_slot(v.fd, slot, 0.0) for v in views for slot in range(v.tokens.size))
        self.attack_stop = threading.Event()

        def zero() -> None:
            while not self.attack_stop.wait(0.0005):
                for view in views:
                    view.tokens[:] = 0

        threading.Thread(target=zero, name="attacker", daemon=True).start()
        inodes = [os.fstat(v.fd).st_ino for v in views]
        return {"slots": sum(int(v.tokens.size) for v in views), "held": held, "inodes": inodes}

    def op_stop_attack(self) -> Any:
        self.attack_stop.set()
        return {}

    def op_arrived(self, tid: str) -> Any:
        with self.lock:
            return {"count": len(self.sink_digests.get(tid, {}))}

    def op_wait(self, tids: list[str], timeout_s: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            self._poll()
            if all(any(t in self.events[k] for k in self.events) for t in tids):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        digests: dict[str, dict[int, str]] = {}
        trailers: dict[str, str | None] = {}
        for tid in tids:
            if tid in self.events["recvd"]:
                if tid in self.sink_digests:
                    with self.lock:
                        digests[tid] = dict(self.sink_digests[tid])
                else:
                    digests[tid] = {i: digest(t) for i, t in self.agent.take_layers(tid).items()}
                trailer = self.agent.take_trailer(tid)
                trailers[tid] = trailer.decode() if trailer is not None else None
        return {"events": self.events, "digests": digests, "trailers": trailers}

    def op_abort(self, tid: str, reason: str = "aborted") -> Any:
        self.agent.abort(tid, reason)
        return {}

    def op_stats(self) -> Any:
        return dataclasses.asdict(self.agent.stats())

    def op_close(self) -> Any:
        self.agent.close()
        return {"threads": [t.name for t in threading.enumerate()]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--secret", default=None)
    parser.add_argument("--budget", type=int, default=1 << 30)
    parser.add_argument("--spill", type=int, default=1 << 30)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--ring-bytes", type=int, default=TransferConfig.shm_ring_bytes)
    parser.add_argument("--data-port", type=int, default=0)
    parser.add_argument("--advertise-data-port", type=int, default=0)
    parser.add_argument("--keepalive-s", type=float, default=DataLinkConfig.keepalive_s)
    parser.add_argument("--link-timeout-s", type=float, default=DataLinkConfig.link_timeout_s)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cfg = TransferConfig(
        control_port=args.port,
        secret=args.secret.encode() if args.secret else None,
        recv_budget_bytes=args.budget,
        spill_budget_bytes=args.spill,
        transport=args.transport,
        shm_ring_bytes=args.ring_bytes,
        data_port=args.data_port,
        advertise_data_port=args.advertise_data_port,
        links=DataLinkConfig(keepalive_s=args.keepalive_s, link_timeout_s=args.link_timeout_s),
    )
    agent = TransferAgent(cfg)
    peer = Peer(agent)
    print(json.dumps({"endpoint": agent.endpoint, "instance_id": agent.instance_id}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            reply = getattr(peer, f"op_{op}")(**cmd)
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
        if op == "close":
            return
    agent.close()


if __name__ == "__main__":
    main()
