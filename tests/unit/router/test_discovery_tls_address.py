"""TLS to etcd in the address: ``etcd+https://HOST:PORT[/prefix]?ca=&cert=&key=`` and the
``--discovery-ca/-cert/-key`` options that add to it (the handshake: tests/integration/test_etcd_tls.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvwire.discovery.address import DiscoveryKind, parse_discovery_address, with_tls_files
from kvwire.errors import ConfigError


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name in ("ca", "cert", "key"):
        path = tmp_path / f"dir with space/{name}.pem"
        path.parent.mkdir(exist_ok=True)
        path.write_text("x")
        out[name] = str(path)
    return out


def test_https_address_with_files_round_trips(files: dict[str, str]) -> None:
    text = with_tls_files("etcd://h:2379/team", files["ca"], files["cert"], files["key"])
    assert text.startswith("etcd+https://h:2379/team?")
    target = parse_discovery_address(text)
    assert (target.kind, target.address, target.prefix) == (DiscoveryKind.ETCD, "https://h:2379", "/team/")
    assert target.tls is not None and (target.tls.ca_file, target.tls.cert_file, target.tls.key_file) == (
        files["ca"], files["cert"], files["key"])
    assert parse_discovery_address(str(target)) == target
    bare = parse_discovery_address("etcd+https://h:2379")  # the system's trust store, no client cert
    assert bare.address == "https://h:2379" and bare.tls is not None and bare.tls.ca_file is None
    assert parse_discovery_address("etcd+http://h:1").address == "http://h:1"
    assert with_tls_files("etcd://h:1") == "etcd://h:1"  # no option given: unchanged


def test_bad_tls_options_fail_clearly(files: dict[str, str], tmp_path: Path) -> None:
    cases = [
        (f"etcd+https://h:1?ca={tmp_path}/missing.pem", "does not exist"),
        (f"etcd+https://h:1?cert={files['cert']}", "cert and key together"),
        (f"etcd+https://h:1?ca={files['ca']}&ca={files['ca']}", "twice"),
        (f"etcd+https://h:1?cafile={files['ca']}", "unknown etcd option 'cafile'"),
        (f"etcd://h:1?ca={files['ca']}", r"need an etcd\+https"),
    ]
    for text, message in cases:
        with pytest.raises(ConfigError, match=message):
            parse_discovery_address(text)
    with pytest.raises(ConfigError, match="etcd addresses only"):
        with_tls_files("tcp://h:1", files["ca"])
    not_pem = parse_discovery_address(f"etcd+https://h:1?ca={files['ca']}")
    with pytest.raises(ConfigError, match="unusable"):
        not_pem.ssl_context()


def test_router_and_serve_options_add_the_files(files: dict[str, str]) -> None:
    from kvwire.router.cli import add_arguments as router_arguments
    from kvwire.router.cli import config_from_args
    from kvwire.server.cli import add_arguments as serve_arguments
    from kvwire.server.cli import server_config_from_args

    tls = ["--discovery-ca", files["ca"], "--discovery-cert", files["cert"], "--discovery-key", files["key"]]
    parser = argparse.ArgumentParser()
    router_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--discovery", "etcd://h:2379/x", *tls]))
    target = cfg.discovery_target
    assert target is not None and target.address == "https://h:2379" and target.prefix == "/x/"
    assert target.tls is not None and target.tls.cert_file == files["cert"]

    parser = argparse.ArgumentParser()
    serve_arguments(parser)
    scfg = server_config_from_args(parser.parse_args(["--router", "etcd://h:2379", *tls]))
    assert scfg.router_address is not None
    assert parse_discovery_address(scfg.router_address).tls == target.tls
    with pytest.raises(ConfigError, match="need --router"):
        server_config_from_args(parser.parse_args(tls))
