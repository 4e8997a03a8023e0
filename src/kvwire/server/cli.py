"""``kvwire serve``: one engine behind the OpenAI API (role both|prefill|decode), optionally registered
with a router. Flags (and ``KVWIRE_NCCL_*``, ``$KVWIRE_SECRET``, ``$KVWIRE_API_KEY``) become the frozen
:class:`ServeConfigs` here, once: :func:`serve_configs_from_args` is the process's one config builder
(``kvwire up`` starts its instances as ``kvwire serve`` children, which build theirs the same way)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from kvwire.discovery.address import add_tls_arguments, auth_of_args, tls_files_of, with_discovery_options
from kvwire.errors import ConfigError, KvwireError
from kvwire.http.front_door import ApiKeyConfig, keys_from_cli
from kvwire.protocol.kv_params import Role, TransferMode
from kvwire.secrets_config import add_secret_arguments, check_exposure, load_secret
from kvwire.server.config import KVLoadFailure, ServerConfig, public_host
from kvwire.transfer.config import ControlLimits, DataLinkConfig, TransferConfig, nccl_from_env
from kvwire.transfer.enums import Backend, Transport

if TYPE_CHECKING:
    from kvwire.engine.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServeConfigs:
    """Everything one ``kvwire serve`` process runs with, built once from its flags and environment."""

    server: ServerConfig
    engine: EngineConfig
    secret: str | None = dataclasses.field(default=None, repr=False)  # never in a repr or log


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny",
                        help="model name (tiny, smollm2-135m, ...), .gguf file, HF directory or Hugging "
                             "Face model id (ORG/NAME, ORG/NAME-GGUF:QUANT; its cache, HF_TOKEN and "
                             "HF_HUB_OFFLINE apply)")
    parser.add_argument("--revision", default=None, help="branch, tag or commit of a Hugging Face model id")
    parser.add_argument("--gguf-file", default=None, help="the .gguf file of a Hugging Face GGUF repo")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory or Hugging Face model id (default: the model's own)")
    parser.add_argument("--served-model-name", default=None, help="name clients send (default: the model's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    parser.add_argument("--quantization", default="auto", choices=("auto", "none", "gguf", "int8", "int4"),
                        help="linear weights: auto (a GGUF on the CPU as the file holds them), none "
                             "(dense --dtype, exact), gguf, int8 or int4 (CPU, one rank)")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="CPU: torch threads (default: OMP_NUM_THREADS, else half the cores)")
    parser.add_argument("--packed-prompts", action="store_true",
                        help="quantized modes: prompts through the packed kernels too (no bf16 copy)")
    parser.add_argument("--no-cpu-malloc-tuning", dest="cpu_malloc_tuning", action="store_false",
                        help="CPU: leave glibc's malloc thresholds as they are (default: the engine "
                             "raises them so large per-layer buffers are not unmapped every step)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    parser.add_argument("--role", choices=[r.value for r in Role], default=Role.BOTH.value)
    parser.add_argument("--router", "--discovery", dest="router", action="append", default=None,
                        metavar="tcp://H:P|etcd[+https]://H:P[/prefix]",
                        help="where to register: a router's heartbeat socket (tcp://; repeat for several "
                             "routers in front of the same instances, each gets every heartbeat) or etcd "
                             "(etcd:// or etcd+https://, alone: every router watches it)")
    add_tls_arguments(parser)
    parser.add_argument("--heartbeat-interval-s", type=float, default=2.0)
    parser.add_argument("--instance-id", default=None, help="stable instance name (default: random)")
    parser.add_argument("--advertise-host", default=None, help="host in the URL given to the router")
    parser.add_argument("--kv-port", type=int, default=0, help="KV transfer agent port (0: any free)")
    parser.add_argument("--kv-data-port", type=int, default=0, help="KV TCP data plane port (0: any free)")
    parser.add_argument("--kv-advertise-host", default=None,
                        help="host P/D peers dial for this instance's KV agent when it differs from what "
                             "it binds (NAT, proxy, Kubernetes Service); the agent then binds --host")
    parser.add_argument("--kv-advertise-port", type=int, default=0,
                        help="KV control port peers dial (0: the bound --kv-port)")
    parser.add_argument("--kv-advertise-data-port", type=int, default=0,
                        help="KV TCP data port peers dial (0: the bound --kv-data-port)")
    parser.add_argument("--kv-mode", choices=[m.value for m in TransferMode], default=TransferMode.PUSH.value,
                        help="default P/D transfer mode (the router's kv_transfer_params.mode wins)")
    parser.add_argument("--kv-deadline-s", type=float, default=30.0,
                        help="push transfer deadline / pull lease of P's blocks")
    parser.add_argument("--kv-transport", choices=[t.value for t in Transport], default=Transport.AUTO.value,
                        help="KV data plane: auto (negotiated per peer: ipc > shm > nccl > tcp) or forced")
    parser.add_argument("--kv-load-failure-policy", choices=[p.value for p in KVLoadFailure],
                        default=KVLoadFailure.RECOMPUTE.value,
                        help="decode side: recompute the prompt or fail the request when KV does not arrive")
    _add_kv_limit_arguments(parser)
    _add_data_link_arguments(parser)
    parser.add_argument("--shutdown-deadline-s", type=float, default=10.0)
    parser.add_argument("--drain-timeout-s", type=float, default=60.0,
                        help="on SIGUSR1: deregister, refuse new requests, let in-flight ones finish for "
                             "at most this long, then stop (default %(default)s)")
    parser.add_argument("--client-write-timeout-s", type=float, default=30.0,
                        help="cut off a client that reads nothing of its response for this long")
    parser.add_argument("--engine-stall-timeout-s", type=float, default=120.0,
                        help="fail in-flight requests with 503 (and /health) when no engine step completes "
                             "for this long; 0: off")
    parser.add_argument("--api-key", action="append", default=None,
                        help="key clients must send as 'Authorization: Bearer KEY' (repeatable; default: "
                             "$KVWIRE_API_KEY, else no authentication); /health stays open")
    parser.add_argument("--open-endpoint", action="append", choices=["metrics"], default=[],
                        help="serve /metrics without an API key")
    add_secret_arguments(parser)
    bounds = parser.add_argument_group("bounds on what clients send")
    bounds.add_argument("--max-request-bytes", type=int, default=ServerConfig.max_request_bytes,
                        help="largest accepted request body; larger: 413 (default %(default)s)")
    bounds.add_argument("--http-idle-timeout-s", type=float, default=ServerConfig.http_idle_timeout_s,
                        help="close a connection with no complete request head for this long (new or "
                             "idle; default %(default)s)")
    bounds.add_argument("--http-body-timeout-s", type=float, default=ServerConfig.http_body_timeout_s,
                        help="answer 408 when a request body does not arrive within this (default "
                             "%(default)s)")
    bounds.add_argument("--max-waiting-requests", type=int, default=ServerConfig.max_waiting_requests,
                        help="requests admitted and not yet computing at most; more: 429 with "
                             "Retry-After (0: no bound; default %(default)s)")
    sizing = parser.add_argument_group("engine sizing (default: derived from the model and device)")
    sizing.add_argument("--block-size", type=int, default=None)
    sizing.add_argument("--num-kv-blocks", type=int, default=None)
    sizing.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="CUDA: share of the GPU's memory this instance may hold, weights included "
                             "(as vLLM's; default: the KV cache takes 0.8 of what is free; `kvwire up` "
                             "gives instances sharing a GPU 0.9 / their number)")
    sizing.add_argument("--max-model-len", type=int, default=None)
    sizing.add_argument("--max-num-seqs", type=int, default=None)
    sizing.add_argument("--max-num-batched-tokens", type=int, default=None)
    sizing.add_argument("--seed", type=int, default=None, help="engine sampler seed")
    sizing.add_argument("--tensor-parallel-size", "--tp", type=int, default=None, dest="tensor_parallel_size",
                        help="ranks (processes; GPUs on CUDA) the model is split over (default 1)")


def _add_kv_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """What P/D peers can make the KV agent's control plane hold or trust (decision 116; the
    defaults are ControlLimits')."""
    d = ControlLimits()
    group = parser.add_argument_group("KV transfer control-plane bounds (counted when hit: "
                                      "kvwire_transfer_limit_hits_total)")
    group.add_argument("--kv-max-control-message-bytes", type=int, default=d.max_message_bytes,
                       help="largest control frame a peer may send (larger: dropped, peer disconnected)")
    group.add_argument("--kv-min-peer-deadline-s", type=float, default=d.min_peer_deadline_s,
                       help="a peer's Offer/Pull lease is raised to at least this")
    group.add_argument("--kv-max-peer-deadline-s", type=float, default=d.max_peer_deadline_s,
                       help="... and lowered to at most this (not finite: the message is refused)")
    group.add_argument("--kv-max-early-grants", type=int, default=d.max_early_grants,
                       help="P: receivers' grants kept before the send starts, in all")
    group.add_argument("--kv-max-early-grants-per-peer", type=int, default=d.max_early_grants_per_peer,
                       help="P: ... per receiver")
    group.add_argument("--kv-max-pending-per-peer", type=int, default=d.max_pending_per_peer,
                       help="per peer: its offers not expected yet, its pulls of transfers not started yet")
    group.add_argument("--kv-max-unexpected-bytes-per-peer", type=int,
                       default=d.max_unexpected_bytes_per_peer,
                       help="D: receive memory one peer's offers not expected yet may be granted; an offer "
                            "past it waits for the request (0: a quarter of the receive budget)")
    group.add_argument("--kv-max-pending-pulls", type=int, default=d.max_pending_pulls,
                       help="P: pulls of transfers not started yet, in all")
    group.add_argument("--kv-max-pending-transfers", type=int, default=65536,
                       help="transfers the KV agent tracks, per side")
    group.add_argument("--kv-max-peers", type=int, default=d.max_peers,
                       help="peer endpoints whose epoch is remembered (least recently heard forgotten)")
    group.add_argument("--kv-max-admission-wait-s", type=float, default=d.max_admission_wait_s,
                       help="D, push: how long a live P that has not yet taken the request up (its HTTP "
                            "server or queue holds it) keeps D's lease renewed (decision 128)")
    group.add_argument("--kv-max-unsolicited-wait-s", type=float, default=d.max_unsolicited_wait_s,
                       help="D, push: how long an offer the request has not claimed yet is kept from its "
                            "arrival, whatever P renews; then P's send fails (decision 159)")


def kv_limits_from_args(args: argparse.Namespace) -> ControlLimits:
    return ControlLimits(
        max_message_bytes=args.kv_max_control_message_bytes, min_peer_deadline_s=args.kv_min_peer_deadline_s,
        max_peer_deadline_s=args.kv_max_peer_deadline_s, max_early_grants=args.kv_max_early_grants,
        max_early_grants_per_peer=args.kv_max_early_grants_per_peer,
        max_pending_per_peer=args.kv_max_pending_per_peer, max_pending_pulls=args.kv_max_pending_pulls,
        max_unexpected_bytes_per_peer=args.kv_max_unexpected_bytes_per_peer,
        max_peers=args.kv_max_peers, max_admission_wait_s=args.kv_max_admission_wait_s,
        max_unsolicited_wait_s=args.kv_max_unsolicited_wait_s,
    )


def _add_data_link_arguments(parser: argparse.ArgumentParser) -> None:
    """Bounds of the KV data-plane listeners and links (DataLinkConfig, decision 115)."""
    links = DataLinkConfig()
    group = parser.add_argument_group("KV data-plane links (tcp, shm, ipc)")
    group.add_argument("--kv-data-max-connections", type=int, default=links.max_connections,
                       help="connections one data-plane listener holds at once; more are closed at once")
    group.add_argument("--kv-data-max-connections-per-peer", type=int, default=links.max_connections_per_peer,
                       help="... of them from one peer address (TCP: IP; same host: process)")
    group.add_argument("--kv-data-handshake-timeout-s", type=float, default=links.handshake_timeout_s,
                       help="close a data connection that has not finished its hello within this")
    group.add_argument("--kv-data-keepalive-s", type=float, default=links.keepalive_s,
                       help="heartbeat / TCP keepalive interval of an idle data link")
    group.add_argument("--kv-data-link-timeout-s", type=float, default=links.link_timeout_s,
                       help="cut a data link that moves nothing for this long (a write without progress, "
                            "no heartbeat heard): its transfers fail peer_lost")
    group.add_argument("--kv-data-max-granted-dests-per-peer", type=int,
                       default=links.max_granted_dests_per_peer,
                       help="one-copy destinations (shm, ipc) kept from one peer's grants; more are not kept")
    group.add_argument("--kv-data-max-granted-dests", type=int, default=links.max_granted_dests,
                       help="... from all peers together")


def _data_links_of(args: argparse.Namespace) -> DataLinkConfig:
    return DataLinkConfig(
        max_connections=args.kv_data_max_connections,
        max_connections_per_peer=args.kv_data_max_connections_per_peer,
        handshake_timeout_s=args.kv_data_handshake_timeout_s,
        keepalive_s=args.kv_data_keepalive_s,
        link_timeout_s=args.kv_data_link_timeout_s,
        max_granted_dests_per_peer=args.kv_data_max_granted_dests_per_peer,
        max_granted_dests=args.kv_data_max_granted_dests,
    )


def _registration_address(args: argparse.Namespace) -> str | None:
    """``--router`` (joined), with ``--discovery-ca/-cert/-key`` and ``--discovery-user`` /
    ``--discovery-password-file`` added to an etcd address."""
    if not args.router:
        if any(tls_files_of(args)):
            raise ConfigError("--discovery-ca/--discovery-cert/--discovery-key need --router etcd+https://...")
        if any(auth_of_args(args)):
            raise ConfigError("--discovery-user/--discovery-password-file need --router etcd://...")
        return None
    return with_discovery_options(",".join(args.router), args)


def serve_configs_from_args(args: argparse.Namespace) -> ServeConfigs:
    """The process's one config builder: engine, then server (its transfer agent's config inside),
    with the shared secret read once (raises ConfigError)."""
    engine = engine_config_from_args(args)
    secret = load_secret(args.secret_file)
    return ServeConfigs(server=server_config_from_args(args, secret), engine=engine, secret=secret)


def server_config_from_args(args: argparse.Namespace, secret: str | None = None) -> ServerConfig:
    """The server's config; ``secret`` (already loaded) goes to the transfer agent."""
    return ServerConfig(
        host=args.host,
        port=args.port,
        role=Role(args.role),
        served_model_name=args.served_model_name,
        router_address=_registration_address(args),
        heartbeat_interval_s=args.heartbeat_interval_s,
        instance_id=args.instance_id,
        advertise_host=args.advertise_host,
        kv_mode=TransferMode(args.kv_mode),
        kv_deadline_s=args.kv_deadline_s,
        kv_load_failure_policy=KVLoadFailure(args.kv_load_failure_policy),
        transfer=transfer_config_from_args(args, secret),
        shutdown_deadline_s=args.shutdown_deadline_s,
        drain_timeout_s=args.drain_timeout_s,
        client_write_timeout_s=args.client_write_timeout_s,
        engine_stall_timeout_s=args.engine_stall_timeout_s,
        api_keys=ApiKeyConfig(keys_from_cli(args.api_key, os.environ),
                              frozenset(f"/{name}" for name in args.open_endpoint)),
        max_request_bytes=args.max_request_bytes, max_waiting_requests=args.max_waiting_requests,
        http_idle_timeout_s=args.http_idle_timeout_s, http_body_timeout_s=args.http_body_timeout_s,
    )


def transfer_config_from_args(args: argparse.Namespace, secret: str | None) -> TransferConfig:
    """The KV transfer agent's config (role prefill/decode): ``--kv-*`` flags, the device, the secret
    and ``KVWIRE_NCCL_*`` (the one place this process reads them). The agent binds ``--host`` when
    peers are told another host (``--kv-advertise-host``), else the host it advertises."""
    _check_kv_flags(args)
    advertised = public_host(args.host, args.advertise_host)
    return TransferConfig(
        host=args.host if args.kv_advertise_host else advertised,
        control_port=args.kv_port, data_port=args.kv_data_port,
        advertise_host=args.kv_advertise_host, advertise_control_port=args.kv_advertise_port,
        advertise_data_port=args.kv_advertise_data_port,
        backend=Backend.NCCL if args.device.startswith("cuda") else Backend.TCP,
        transport=Transport(args.kv_transport), device=args.device,
        default_deadline_s=args.kv_deadline_s, secret=secret.encode() if secret else None,
        nccl=nccl_from_env(), limits=kv_limits_from_args(args),
        max_pending_transfers=args.kv_max_pending_transfers, links=_data_links_of(args),
    )


def _check_kv_flags(args: argparse.Namespace) -> None:
    """The ``--kv-*`` values refused with the flag's own name (before TransferConfig's checks)."""
    for name in ("kv_port", "kv_data_port", "kv_advertise_port", "kv_advertise_data_port"):
        if not 0 <= getattr(args, name) <= 65535:
            raise ConfigError(f"{name} must be in [0, 65535], got {getattr(args, name)}")
    if args.kv_advertise_host is not None and not args.kv_advertise_host.strip():
        raise ConfigError("kv_advertise_host must not be empty (omit it to advertise the bound host)")
    if args.kv_deadline_s <= 0:
        raise ConfigError(f"kv_deadline_s must be > 0, got {args.kv_deadline_s}")
    if args.kv_max_pending_transfers < 1:
        raise ConfigError(f"kv_max_pending_transfers must be >= 1, got {args.kv_max_pending_transfers}")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from kvwire.engine.config import EngineConfig

    # Only flags given on the command line override the engine's own defaults.
    sizing = {
        name: getattr(args, name)
        for name in ("block_size", "num_kv_blocks", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "seed", "tensor_parallel_size", "gpu_memory_utilization")
        if getattr(args, name) is not None
    }
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                        quantization=args.quantization, cpu_threads=args.cpu_threads,
                        dense_prompt_weights=not args.packed_prompts,
                        cpu_malloc_tuning=args.cpu_malloc_tuning,
                        kv_load_failure_policy=args.kv_load_failure_policy, revision=args.revision,
                        gguf_file=args.gguf_file, tokenizer=args.tokenizer, **sizing)


def _run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop when it is installed (logged either way)."""
    try:
        import uvloop
    except ImportError:
        logger.info("event loop: asyncio (uvloop not installed)")
        return asyncio.run(main)
    logger.info("event loop: uvloop")
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            result: int = runner.run(main)
            return result
    uvloop.install()
    return asyncio.run(main)


def run(args: argparse.Namespace) -> int:
    try:
        configs = serve_configs_from_args(args)
        server = configs.server
        kv_hosts = [] if server.role is Role.BOTH else [server.transfer.host]  # the KV agent binds this
        check_exposure("kvwire serve", server.host, kv_hosts,
                       secret=configs.secret is not None, api_key=server.api_keys.enabled,
                       insecure=args.insecure)
    except ConfigError as exc:
        print(f"kvwire serve: {exc}", file=sys.stderr)
        return 2
    from kvwire.server.instance import serve

    try:
        return _run_loop(serve(configs.server, configs.engine, configs.secret))
    except (KvwireError, OSError) as exc:
        logger.error("kvwire serve failed: %s", exc)
        return 1
