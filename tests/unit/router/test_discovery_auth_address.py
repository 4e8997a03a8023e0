"""etcd credentials in the address (``etcd://USER[:PASSWORD]@HOST:PORT[?password_file=]``, the
environment, ``--discovery-user/--discovery-password-file``); against a real etcd:
tests/integration/test_etcd_auth.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvwire.discovery.address import PASSWORD_ENV, parse_discovery_address, with_auth
from kvwire.errors import ConfigError


@pytest.fixture
def secret(tmp_path: Path) -> str:
    path = tmp_path / "pass word"
    path.write_text("from-file\nsecond line ignored\n")
    return str(path)


def test_password_sources_in_order(secret: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    inline = parse_discovery_address("etcd://kv:p%40ss%3Aw@h:2379/team")
    assert inline.auth is not None and (inline.auth.user, inline.auth.password) == ("kv", "p@ss:w")
    assert "p@ss" not in str(inline) and "p@ss" not in repr(inline) and str(inline) == "etcd://kv@h:2379/team/"
    from_file = parse_discovery_address(with_auth("etcd://h:2379", "kv", secret))
    assert from_file.auth is not None and from_file.auth.password == "from-file"
    assert parse_discovery_address(str(from_file)) == from_file  # the file travels, not the password
    from_env = parse_discovery_address("etcd://kv@h:2379")
    assert from_env.auth is not None and from_env.auth.password == "from-env"
    assert parse_discovery_address("etcd://h:2379").auth is None


def test_missing_or_misplaced_credentials_fail_clearly(
    secret: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cases = [
        ("etcd://kv@h:2379", f"without a password.*{PASSWORD_ENV}"),
        (f"etcd://h:2379?password_file={secret}", "needs a user"),
        (f"etcd://kv@h:2379?password_file={tmp_path}/missing", "does not exist"),
        (f"etcd://kv@h:2379?password_file={empty}", "is empty"),
    ]
    for text, message in cases:
        with pytest.raises(ConfigError, match=message):
            parse_discovery_address(text)
    with pytest.raises(ConfigError) as info:
        parse_discovery_address("etcd://kv:hunter2@h:2379?cafile=x")
    assert "hunter2" not in str(info.value)  # errors never echo the password
    with pytest.raises(ConfigError, match="etcd addresses only"):
        with_auth("tcp://h:1", "kv")
    with pytest.raises(ConfigError, match="names a user too"):
        with_auth("etcd://a@h:1", "kv")


def test_router_and_serve_options_add_the_credentials(secret: str) -> None:
    from kvwire.router.cli import add_arguments as router_arguments
    from kvwire.router.cli import config_from_args
    from kvwire.server.cli import add_arguments as serve_arguments
    from kvwire.server.cli import server_config_from_args

    auth = ["--discovery-user", "kv", "--discovery-password-file", secret]
    parser = argparse.ArgumentParser()
    router_arguments(parser)
    target = config_from_args(parser.parse_args(["--discovery", "etcd://h:2379/x", *auth])).discovery_target
    assert target is not None and target.auth is not None and target.auth.password == "from-file"
    parser = argparse.ArgumentParser()
    serve_arguments(parser)
    scfg = server_config_from_args(parser.parse_args(["--router", "etcd://h:2379/x", *auth]))
    assert scfg.router_address is not None and parse_discovery_address(scfg.router_address) == target
    with pytest.raises(ConfigError, match="need --router"):
        server_config_from_args(parser.parse_args(auth))
