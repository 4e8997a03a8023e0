"""Client request validation, SSE token metering, config validation, CLI wiring, no torch."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvwire.errors import ConfigError, InvalidRequestError
from kvwire.protocol.kv_params import TransferMode
from kvwire.router import cli
from kvwire.router.config import Policy, RouterConfig
from kvwire.router.relay import SSETokenMeter
from kvwire.router.request import parse_client_request


def test_parse_and_derive() -> None:
    raw = json.dumps({"model": "m", "prompt": "abcdefgh", "max_tokens": 5, "stream": True}).encode()
    req = parse_client_request("/v1/completions", raw, {"Authorization": "Bearer k", "X-Other": "no"})
    assert (req.model, req.stream, req.max_new_tokens, req.est_prompt_tokens) == ("m", True, 5, 3)
    assert req.headers == {"Content-Type": "application/json", "Authorization": "Bearer k"}
    derived = json.loads(req.derived_body(max_tokens=1, stream=None))
    assert derived == {"model": "m", "prompt": "abcdefgh", "max_tokens": 1}
    assert req.raw == raw  # untouched


@pytest.mark.parametrize(
    ("path", "raw", "match"),
    [
        ("/v1/completions", b"", "empty"),
        ("/v1/completions", b"{", "not valid JSON"),
        ("/v1/completions", b"[]", "JSON object"),
        ("/v1/completions", b'{"prompt": "x", "stream": 1}', "stream"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": true}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "model": 3}', "model"),
        ("/v1/completions", b'{"max_tokens": 3}', "prompt"),
        ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
    ],
)
def test_invalid_requests(path: str, raw: bytes, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        parse_client_request(path, raw, {})


def _event(data: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def test_sse_meter_counts_only_token_events_across_splits() -> None:
    stream = b"".join([
        _event({"choices": [{"delta": {"role": "assistant", "content": ""}}]}),  # role only
        _event({"choices": [{"delta": {"content": "a"}}]}),
        _event({"choices": [{"text": "b"}]}),
        _event({"choices": [], "usage": {"total_tokens": 3}}),  # usage only
        b"data: [DONE]\n\n",
    ])
    meter = SSETokenMeter()
    assert sum(meter.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) == 2
    meter = SSETokenMeter()
    assert meter.feed(stream.replace(b"\n\n", b"\r\n\r\n")) == 2


def test_config_validation() -> None:
    with pytest.raises(ConfigError):
        RouterConfig(port=70000)
    with pytest.raises(ConfigError):
        RouterConfig(instance_ttl_s=0)
    with pytest.raises(ConfigError):
        RouterConfig(max_connect_retries=-1)
    with pytest.raises(ConfigError):
        RouterConfig(policy="fastest")  # type: ignore[arg-type]
    assert RouterConfig(instance_ttl_s=0.6).sweep_interval_s == pytest.approx(0.15)


def test_cli_arguments_build_config(tmp_path: Path) -> None:
    secret = "k" * 32
    (tmp_path / "secret").write_text(secret + "\n")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        ["--port", "0", "--discovery-port", "0", "--policy", "random", "--mode", "pull",
         "--secret-file", str(tmp_path / "secret"), "--instance-ttl-s", "1.5"]
    )
    cfg = cli.config_from_args(args)
    assert (cfg.policy, cfg.mode, cfg.secret) == (Policy.RANDOM, TransferMode.PULL, secret)
    assert cfg.instance_ttl_s == 1.5


def test_router_does_not_import_torch() -> None:
    code = (
        "import kvwire.router.app, kvwire.router.cli, kvwire.discovery, sys; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("value", [{"transfer_id": "t", "role": "decode"}, None, "x"])
def test_client_kv_transfer_params_are_dropped_from_body_and_raw(value: object) -> None:
    raw = json.dumps({"prompt": "hi", "kv_transfer_params": value, "max_tokens": 3}).encode()
    creq = parse_client_request("/v1/completions", raw, {})
    assert creq.client_kv_params
    assert "kv_transfer_params" not in creq.body and b"kv_transfer_params" not in creq.raw
    assert json.loads(creq.raw) == {"prompt": "hi", "max_tokens": 3}
    clean = parse_client_request("/v1/completions", b'{"prompt": "hi"}', {})
    assert not clean.client_kv_params and clean.raw == b'{"prompt": "hi"}'  # untouched bytes
