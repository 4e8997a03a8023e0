"""Secure by default (decision 124): the cluster secret from a file or the environment, at least 32
bytes, never on a command line or in a message; no listening beyond loopback without it."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from kvwire.cluster import cli as up_cli
from kvwire.errors import ConfigError
from kvwire.router import cli as router_cli
from kvwire.secrets_config import (
    MIN_SECRET_BYTES,
    check_exposure,
    generate_secret,
    is_loopback,
    load_secret,
)

GOOD = "g" * MIN_SECRET_BYTES


def test_generated_secrets_are_long_and_fresh() -> None:
    a, b = generate_secret(), generate_secret()
    assert len(a.encode()) >= MIN_SECRET_BYTES and a != b


def test_secret_from_file_then_env_and_short_ones_refused_without_their_value(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(GOOD + "\n")
    assert load_secret(str(path), {"KVWIRE_SECRET": "e" * 40}) == GOOD  # the file wins
    assert load_secret(None, {"KVWIRE_SECRET": "e" * 40}) == "e" * 40
    assert load_secret(None, {}) is None
    with pytest.raises(ConfigError, match="at least 32") as err:
        load_secret(None, {"KVWIRE_SECRET": "short-secret-value"})
    assert "short-secret-value" not in str(err.value)
    with pytest.raises(ConfigError, match="cannot read the secret file"):
        load_secret(str(tmp_path / "missing"), {})
    path.write_bytes(b"x" * 5000)
    with pytest.raises(ConfigError, match="larger than"):
        load_secret(str(path), {})


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("example.internal", False),
])
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_exposure_needs_a_secret_and_for_http_an_api_key_unless_insecure() -> None:
    check_exposure("x", "127.0.0.1", ["127.0.0.1"], secret=False, api_key=False, insecure=False)
    with pytest.raises(ConfigError, match=r"no shared secret.*KVWIRE_SECRET.*--insecure"):
        check_exposure("x", "127.0.0.1", ["0.0.0.0"], secret=False, api_key=False, insecure=False)
    with pytest.raises(ConfigError, match=r"no API key.*--insecure"):
        check_exposure("x", "0.0.0.0", [], secret=True, api_key=False, insecure=False)
    check_exposure("x", "0.0.0.0", ["0.0.0.0"], secret=True, api_key=True, insecure=False)
    check_exposure("x", "0.0.0.0", ["0.0.0.0"], secret=False, api_key=False, insecure=True)


def _router_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    router_cli.add_arguments(parser)
    return parser.parse_args(["--port", "0", "--discovery-port", "0", *argv])


def test_router_refuses_a_public_bind_before_starting(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVWIRE_SECRET", raising=False)
    monkeypatch.delenv("KVWIRE_API_KEY", raising=False)
    assert router_cli.run(_router_args("--host", "0.0.0.0")) == 2
    assert "no shared secret" in capsys.readouterr().err
    assert router_cli.run(_router_args("--discovery-host", "0.0.0.0")) == 2
    assert "0.0.0.0" in capsys.readouterr().err


def test_kvwire_up_makes_a_secret_per_cluster_and_passes_it_in_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVWIRE_SECRET", raising=False)
    parser = argparse.ArgumentParser()
    up_cli.add_arguments(parser)
    first = up_cli.spec_from_args(parser.parse_args([]))
    second = up_cli.spec_from_args(parser.parse_args([]))
    assert first.secret and second.secret and first.secret != second.secret
    assert len(first.secret.encode()) >= MIN_SECRET_BYTES
    assert first.secret not in (*first.router_args, *first.serve_args)  # never on a command line
    from kvwire.cluster.local import LocalCluster

    env = LocalCluster(first)._env()
    assert env is not None and env["KVWIRE_SECRET"] == first.secret
    with pytest.raises(ConfigError, match="no API key"):
        up_cli.spec_from_args(parser.parse_args(["--host", "0.0.0.0"]))
    assert up_cli.spec_from_args(parser.parse_args(["--host", "0.0.0.0", "--insecure"])).router_args == (
        "--insecure",)


def test_kvwire_secret_prints_one() -> None:
    code = "import sys; from kvwire.cli import main; sys.exit(main(['secret']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert len(out.stdout.strip().encode()) >= MIN_SECRET_BYTES


def test_kvwire_serve_refuses_a_public_bind_without_a_secret() -> None:
    code = "import sys; from kvwire.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("KVWIRE_SECRET", "KVWIRE_API_KEY")}
    out = subprocess.run([sys.executable, "-c", code, "serve", "--host", "0.0.0.0", "--port", "0"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "no shared secret" in out.stderr and "--insecure" in out.stderr


def test_configs_holding_the_secret_never_show_it() -> None:
    from kvwire.cluster.local import ClusterSpec
    from kvwire.router.config import RouterConfig
    from kvwire.transfer.config import TransferConfig

    for cfg in (RouterConfig(secret=GOOD), ClusterSpec(secret=GOOD), TransferConfig(secret=GOOD.encode())):
        assert GOOD not in repr(cfg)
