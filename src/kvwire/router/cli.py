"""``kvwire router``: run the OpenAI-compatible router with service discovery."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

import zmq

from kvwire.discovery.address import add_tls_arguments, with_discovery_options
from kvwire.errors import ConfigError
from kvwire.http.front_door import ApiKeyConfig, keys_from_cli
from kvwire.protocol.kv_params import TransferMode
from kvwire.router.app import RouterServer
from kvwire.router.config import PdFallback, Policy, RouterConfig
from kvwire.secrets_config import add_secret_arguments, check_exposure, load_secret

log = logging.getLogger(__name__)

T = TypeVar("T")

INSTANCE_API_KEY_ENV = "KVWIRE_INSTANCE_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    parser.add_argument("--host", default=d.host, help="HTTP bind address (default %(default)s)")
    parser.add_argument("--port", type=int, default=d.port, help="HTTP port, 0 = any (default %(default)s)")
    parser.add_argument("--discovery-host", default=d.discovery_host,
                        help="heartbeat (ZeroMQ) bind address (default %(default)s)")
    parser.add_argument("--discovery-port", type=int, default=d.discovery_port,
                        help="heartbeat port; instances use --router tcp://HOST:PORT (default %(default)s)")
    parser.add_argument("--discovery", default="zmq", metavar="zmq|etcd[+https]://HOST:PORT[/prefix]",
                        help="zmq: the embedded heartbeat socket (default); etcd://...: watch instances in "
                             "etcd (any number of routers can); etcd+https://...: etcd over TLS")
    add_tls_arguments(parser)
    parser.add_argument("--instance-ttl-s", type=float, default=d.instance_ttl_s,
                        help="expire an instance after this long without a heartbeat (default %(default)s)")
    parser.add_argument("--policy", choices=[p.value for p in Policy], default=d.policy.value,
                        help="instance selection policy (default %(default)s)")
    parser.add_argument("--mode", choices=[m.value for m in TransferMode], default=d.mode.value,
                        help="P/D KV transfer mode (default %(default)s)")
    parser.add_argument("--kv-params-ttl-s", type=float, default=d.kv_params_ttl_s,
                        help="signed kv_transfer_params expire after this long (default %(default)s)")
    parser.add_argument("--api-key", action="append", default=None,
                        help="key clients must send as 'Authorization: Bearer KEY' (repeatable; "
                             "default: $KVWIRE_API_KEY, else no authentication)")
    parser.add_argument("--instance-api-key", default=None,
                        help="key the router sends to instances (their --api-key; default: "
                             "$KVWIRE_INSTANCE_API_KEY)")
    parser.add_argument("--open-endpoint", action="append", choices=["metrics", "instances"], default=[],
                        help="serve /metrics or /instances without an API key (repeatable; /health "
                             "is always open)")
    parser.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                        help="largest accepted request body (default %(default)s)")
    parser.add_argument("--http-idle-timeout-s", type=float, default=d.http_idle_timeout_s,
                        help="close a client connection with no complete request head for this long "
                             "(new or idle; default %(default)s)")
    parser.add_argument("--http-body-timeout-s", type=float, default=d.http_body_timeout_s,
                        help="answer 408 when a request body does not arrive within this (default "
                             "%(default)s)")
    parser.add_argument("--kv-deadline-s", type=float, default=d.kv_deadline_s,
                        help="lease given to P/D transfers: a silent peer fails a transfer after this "
                             "long (default %(default)s)")
    parser.add_argument("--kv-limit-s", type=float, default=d.kv_limit_s,
                        help="bound on a transfer whose peers stay alive (default %(default)s)")
    parser.add_argument("--max-migrations", type=int, default=d.max_migrations,
                        help="moves of one request to another instance after one died (default %(default)s)")
    parser.add_argument("--upstream-timeout-s", type=float, default=d.upstream_timeout_s,
                        help="limit on one upstream request, streaming included (default %(default)s)")
    parser.add_argument("--client-write-timeout-s", type=float, default=d.client_write_timeout_s,
                        help="cut off a client reading nothing this long (default %(default)s)")
    parser.add_argument("--stream-first-token-from-prefill", action=argparse.BooleanOptionalAction,
                        default=d.stream_first_token_from_prefill,
                        help="push mode, streaming: send P's first token to the client as soon as P has "
                             "it, and D's stream from the second token on (default: on)")
    parser.add_argument("--max-connect-retries", type=int, default=d.max_connect_retries,
                        help="re-dispatches after a refused connection (default %(default)s)")
    parser.add_argument("--decode-local-prefill-tokens", type=int, default=d.decode_local_prefill_tokens,
                        help="kv_aware: skip P when D holds all but fewer than this many prompt tokens "
                             "(0 = never; default %(default)s)")
    parser.add_argument("--tokenizer", default=None,
                        help="prompt tokenizer for KV-aware routing: 'byte', a local HF model directory or a "
                             "Hugging Face model id (default: what the instances announce)")
    parser.add_argument("--kv-index-max-blocks", type=int, default=d.kv_index_max_blocks,
                        help="block hashes the router's KV index keeps (default %(default)s)")
    parser.add_argument("--pd-fallback", choices=[f.value for f in PdFallback], default=d.pd_fallback.value,
                        help="a model with a live decode but no live prefill instance: serve the request "
                             "on decode alone (colocated) or answer 503 (error) (default %(default)s)")
    add_secret_arguments(parser)  # the shared HMAC key: heartbeats signed with it, kv_transfer_params signed
    bounds = parser.add_argument_group("bounds on what peers choose")
    bounds.add_argument("--max-instances", type=int, default=d.max_instances,
                        help="instances the registry holds; heartbeats of new ones beyond are refused "
                             "(default %(default)s)")
    bounds.add_argument("--max-record-ttl-s", type=float, default=d.max_record_ttl_s,
                        help="cap on the ttl_s an instance's heartbeat promises (default %(default)s)")
    bounds.add_argument("--discovery-freshness-s", type=float, default=d.discovery_freshness_s,
                        help="with a secret: refuse a first heartbeat of an instance epoch sent further "
                             "than this from the router's clock (replays; default %(default)s)")
    bounds.add_argument("--upstream-max-connections", type=int, default=d.upstream_max_connections,
                        help="connections to instances in all; more requests wait (default %(default)s)")
    bounds.add_argument("--upstream-max-connections-per-instance", type=int,
                        default=d.upstream_max_connections_per_instance,
                        help="connections to one instance; more requests wait (default %(default)s)")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        host=args.host, port=args.port,
        discovery_host=args.discovery_host, discovery_port=args.discovery_port,
        discovery=with_discovery_options(args.discovery, args),
        instance_ttl_s=args.instance_ttl_s, policy=Policy(args.policy), mode=TransferMode(args.mode),
        secret=load_secret(args.secret_file), max_body_bytes=args.max_body_bytes,
        kv_deadline_s=args.kv_deadline_s,
        http_idle_timeout_s=args.http_idle_timeout_s, http_body_timeout_s=args.http_body_timeout_s,
        kv_limit_s=args.kv_limit_s, max_migrations=args.max_migrations,
        upstream_timeout_s=args.upstream_timeout_s, max_connect_retries=args.max_connect_retries,
        client_write_timeout_s=args.client_write_timeout_s,
        stream_first_token_from_prefill=args.stream_first_token_from_prefill,
        kv_params_ttl_s=args.kv_params_ttl_s,
        api_keys=ApiKeyConfig(keys_from_cli(args.api_key, os.environ),
                              frozenset(f"/{name}" for name in args.open_endpoint)),
        instance_api_key=args.instance_api_key or os.environ.get(INSTANCE_API_KEY_ENV) or None,
        decode_local_prefill_tokens=args.decode_local_prefill_tokens, tokenizer=args.tokenizer,
        kv_index_max_blocks=args.kv_index_max_blocks,
        max_instances=args.max_instances, max_record_ttl_s=args.max_record_ttl_s,
        discovery_freshness_s=args.discovery_freshness_s,
        upstream_max_connections=args.upstream_max_connections,
        upstream_max_connections_per_instance=args.upstream_max_connections_per_instance,
        pd_fallback=PdFallback(args.pd_fallback),
    )


async def serve(cfg: RouterConfig, ready: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM, then stop everything."""
    server = RouterServer(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    print(f"kvwire router: {server.url} (discovery {server.discovery_address})", flush=True)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        log.info("router stopping")
        await server.stop()


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop when it is installed (faster HTTP), else the default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        discovery_hosts = [cfg.discovery_host] if cfg.discovery_target is None else []
        check_exposure("kvwire router", cfg.host, discovery_hosts, secret=cfg.secret is not None,
                       api_key=cfg.api_keys.enabled, insecure=args.insecure)
    except ConfigError as exc:
        print(f"kvwire router: {exc}", file=sys.stderr)
        return 2
    try:
        run_event_loop(serve(cfg))
    except (OSError, zmq.ZMQError) as exc:  # typically a port already in use
        print(f"kvwire router: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0
