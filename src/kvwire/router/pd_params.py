"""The ``kv_transfer_params`` the router gives P and D: minted per transfer, signed with the shared
secret when there is one (instances then refuse unsigned ones; decision 043). Only these ever reach
an instance: a client's own are dropped on parsing (:mod:`kvwire.router.request`, decision 124).
No I/O; event-loop thread."""

from __future__ import annotations

import msgspec

from kvwire.errors import InvalidRequestError
from kvwire.protocol.kv_params import KVTransferParams, Role, TransferMode
from kvwire.protocol.kv_signing import ParamsSigner
from kvwire.router.config import RouterConfig
from kvwire.router.metrics import RouterMetrics
from kvwire.router.registry import InstanceView
from kvwire.router.upstream import UpstreamFailure


class PdParams:
    def __init__(self, cfg: RouterConfig, metrics: RouterMetrics) -> None:
        self._cfg = cfg
        self._metrics = metrics
        # With a shared secret every kv_transfer_params is signed (instances refuse unsigned ones).
        self._signer = ParamsSigner(cfg.secret, cfg.kv_params_ttl_s) if cfg.secret else None

    def push(self, tid: str, role: Role, peer: InstanceView, skip_blocks: int = 0) -> KVTransferParams:
        """Push mode: ``role``'s params naming ``peer``'s KV endpoints."""
        return self._seal(KVTransferParams(
            transfer_id=tid, mode=TransferMode.PUSH, role=role, peer_endpoints=list(peer.info.kv_endpoints),
            peer_instance_id=peer.instance_id, deadline_s=self._cfg.kv_deadline_s, skip_blocks=skip_blocks,
            peer_kv_layout=peer.info.kv_layout, limit_s=self._cfg.kv_limit_s,
        ))

    def pull_prefill(self, tid: str, d: InstanceView) -> KVTransferParams:
        """Pull mode: P's params, naming the D it leases its KV to (decision 044)."""
        return self._seal(KVTransferParams(
            transfer_id=tid, mode=TransferMode.PULL, role=Role.PREFILL,
            peer_endpoints=list(d.info.kv_endpoints), peer_instance_id=d.instance_id,
            deadline_s=self._cfg.kv_deadline_s, limit_s=self._cfg.kv_limit_s,
        ))

    def pull_decode(self, p: InstanceView, answer: bytes) -> KVTransferParams:
        """Pull mode: D's params, from those P returned (role switched to decode); an
        :class:`UpstreamFailure` (502, ``bad_response``) when P's answer holds none that are valid."""
        try:
            raw = msgspec.json.decode(answer).get("kv_transfer_params")
            params = KVTransferParams.from_dict(raw)
        except (msgspec.DecodeError, AttributeError, InvalidRequestError, RecursionError) as exc:
            self._metrics.upstream_errors.labels(role="prefill", kind="bad_response").inc()
            raise UpstreamFailure(
                f"prefill instance {p.instance_id} returned no valid kv_transfer_params: {exc}",
                status=502, kind="bad_response", instance_id=p.instance_id,
            ) from exc
        endpoints = params.peer_endpoints or list(p.info.kv_endpoints)
        peer_id = params.peer_instance_id or p.instance_id
        if self._signer is not None:  # vouch only for what discovery registered, not for P's answer
            endpoints, peer_id = list(p.info.kv_endpoints), p.instance_id
        return self._seal(msgspec.structs.replace(
            params, role=Role.DECODE, mode=TransferMode.PULL, peer_endpoints=endpoints,
            peer_instance_id=peer_id, peer_kv_layout=params.peer_kv_layout or p.info.kv_layout,
            expires_at=None, sig=None,
        ))

    def _seal(self, params: KVTransferParams) -> KVTransferParams:
        return params if self._signer is None else self._signer.sign(params)
