"""Each sending peer gets a shared-memory grant region of its own (decision 127), against real
processes: a second peer that passed the hello (it has the secret) attacks the grant table it was
handed, holding every slot's lock and zeroing every token, while a victim peer sends to the same
receiver in one copy. With one table shared by every link (before decision 127) the victim's writer
found its slot locked or its grant revoked and its transfer failed; now it completes bit-exact."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest
import torch

from kvwire.transfer import TransferAgent, TransferConfig
from kvwire.transfer.enums import KVLayout
from kvwire.transfer.memory import BlockTarget, shared_tensors
from support.shm_planes import shm_plane
from support.transfer_helpers import PeerProcess, digest, has_all, poll_until
from support.waiting import wait_for

SECRET = secrets.token_hex(32)
SHAPE = [2, 12, 16, 4, 32]  # KV_FIRST float32: 12 blocks of 8 KiB halves
LAYERS = 3


def _digests(caches: list[torch.Tensor], block_ids: list[int]) -> list[str]:
    ids = torch.tensor(block_ids, dtype=torch.int64)
    return [digest(c.index_select(1, ids)) for c in caches]


def _source(seed: int) -> list[torch.Tensor]:
    """The caches ``transfer_peer.op_send_blocks`` sends from (same seed, same draws)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen) for _ in range(LAYERS)]


@pytest.fixture
def agent() -> Iterator[TransferAgent]:
    with TransferAgent(TransferConfig(secret=SECRET.encode())) as a:
        yield a


def _send(
    peer: PeerProcess, agent: TransferAgent, tid: str, seed: int, src: list[int], dst: tuple[int, ...]
) -> None:
    agent.expect(tid, num_layers=LAYERS, into_blocks=BlockTarget(dst), deadline_s=30.0)
    peer.call(
        "send_blocks", tid=tid, peer=agent.endpoint, seed=seed, shape=SHAPE, num_layers=LAYERS,
        block_ids=src, layers=list(range(LAYERS)),
    )  # fmt: skip


def test_a_peer_attacking_its_grant_table_cannot_touch_another_peers_grants(agent: TransferAgent) -> None:
    dst = shared_tensors([SHAPE] * LAYERS, torch.float32)  # D: its cache in shared memory
    agent.register_kv_caches(dst, KVLayout.KV_FIRST)
    plane = shm_plane(agent)
    attacker, victim = PeerProcess("--secret", SECRET), PeerProcess("--secret", SECRET)
    try:
        # the attacker is a peer like any other: it links (proving the secret) and sends in one copy
        _send(attacker, agent, "a-1", 1, [1, 2], (4, 5))
        poll_until(agent, has_all("recvd", ["a-1"]), timeout_s=30)
        assert attacker.call("paths")["paths"] == {"one_copy": LAYERS}
        attack = attacker.call("attack_grants")
        assert attack["slots"] > 0 and attack["held"] == attack["slots"]  # every slot of its table locked
        # the victim's transfer, granted and written while the attack goes on
        _send(victim, agent, "v-1", 2, [3, 7], (8, 9))
        events = poll_until(agent, lambda ev: "v-1" in ev["recvd"] or "v-1" in ev["failed"], timeout_s=30)
        assert "v-1" not in events["failed"], events["failed"]
        assert victim.call("paths")["paths"] == {"one_copy": LAYERS}  # in one copy, not the ring
        assert _digests(dst, [8, 9]) == _digests(_source(2), [3, 7])  # intact
        assert plane.unsettled() == {}  # nothing of the victim's quarantined
        with plane.lock:  # the victim's region is not the table the attacker holds
            region = plane.grants.table(victim.instance_id)
            assert region is not None and os.fstat(region.fd).st_ino not in attack["inodes"]
        attacker.call("stop_attack")
        # the attacker's link ends: its region is freed; the victim's stays while its link lives
        attacker.kill()
        gone = attacker.instance_id
        wait_for(lambda: plane.grants.table(gone) is None, 20.0, "the attacker's region freed")
        assert plane.grants.table(victim.instance_id) is region
    finally:
        attacker.kill()
        victim.kill()
