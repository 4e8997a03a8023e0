"""etcd's user/password authentication with a real etcd (auth enabled, tokens living 1 s of
disuse): an instance registers and a router watches as a user allowed the prefix, each taking a
new token when etcd drops theirs; a wrong password or no credentials fail with a clear error.

Needs the ``etcd`` binary (installed by ``scripts/test.sh``); skipped, saying so, where it is missing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwire.cluster.etcd import INSTALL_HINT, LocalEtcd, etcd_binary
from kvwire.discovery.address import PASSWORD_ENV, DiscoveryAddress, parse_discovery_address
from kvwire.discovery.etcd_client import EtcdRegistration
from kvwire.discovery.etcd_gateway import EtcdAuthError, EtcdHttp, b64, prefix_range_end
from kvwire.discovery.heartbeats import InstanceInfo
from kvwire.protocol.kv_params import Role
from kvwire.router.discovery_backend import EtcdDiscovery
from kvwire.router.registry import Registry
from support.waiting import wait_for

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason=f"etcd binary not installed: {INSTALL_HINT}")

PREFIX = "/kvwire/instances/"
PASSWORD = "s3cret pw:@/"  # characters an address would need to escape
TOKEN_TTL_S = 1


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    """etcd with auth on: root, and user ``kv`` with read/write on the default prefix only."""
    with LocalEtcd(extra_args=("--auth-token-ttl", str(TOKEN_TTL_S))) as server:
        admin = EtcdHttp(server.url, timeout_s=5.0)
        for path, body in [
            ("/v3/auth/role/add", {"name": "root"}),
            ("/v3/auth/user/add", {"name": "root", "password": "root-pw"}),
            ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
            ("/v3/auth/role/add", {"name": "kvwire"}),
            ("/v3/auth/role/grant", {"name": "kvwire", "perm": {
                "permType": "READWRITE", "key": b64(PREFIX), "range_end": b64(prefix_range_end(PREFIX))}}),
            ("/v3/auth/user/add", {"name": "kv", "password": PASSWORD}),
            ("/v3/auth/user/grant", {"user": "kv", "role": "kvwire"}),
            ("/v3/auth/enable", {}),
        ]:
            admin.call(path, body)
        admin.close()
        yield server


def _target(etcd: LocalEtcd, tmp_path: Path, password: str) -> DiscoveryAddress:
    secret = tmp_path / "etcd-password"
    secret.write_text(password + "\n")
    target = parse_discovery_address(f"etcd://kv@127.0.0.1:{etcd.client_port}?password_file={secret}")
    assert target.auth is not None and target.auth.password == password and password not in str(target)
    return target


def _token_rejected(url: str, token: str) -> bool:
    request = urllib.request.Request(f"{url}/v3/kv/range", data=json.dumps({"key": b64(PREFIX)}).encode(),
                                     headers={"Authorization": token, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=2.0):
            return False
    except urllib.error.HTTPError as exc:
        return "invalid auth token" in exc.read().decode()


def test_register_and_watch_as_a_user_through_token_expiry(
    etcd: LocalEtcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = _target(etcd, tmp_path, PASSWORD)
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)  # the router's password from the environment
    router_target = parse_discovery_address(f"etcd://kv@127.0.0.1:{etcd.client_port}")
    info = InstanceInfo(instance_id="auth-0", role=Role.DECODE, url="http://127.0.0.1:9", model="m")

    async def scenario() -> None:
        registry = Registry(ttl_s=100.0)
        watcher = EtcdDiscovery(registry, router_target)
        await watcher.start()
        registration = EtcdRegistration(target, info, interval_s=0.5).start()
        try:
            await asyncio.to_thread(wait_for, lambda: registry.get("auth-0") is not None, 10, "registered")
            assert not watcher.stale and watcher.last_error == ""
            # the router's token lapses unused; its next call takes a new one
            token = watcher.client.token
            assert token
            await asyncio.to_thread(wait_for, lambda: _token_rejected(etcd.url, token), 10,  # type: ignore[arg-type]
                                    "the router's token to expire", 1.5 * TOKEN_TTL_S)
            await watcher.client.post("/v3/kv/range", {"key": b64(PREFIX + "auth-0")})
            assert watcher.client.token not in ("", token)
            assert registry.get("auth-0").alive  # type: ignore[union-attr]
        finally:
            registration.close()
            await asyncio.to_thread(wait_for, lambda: registry.get("auth-0") is None, 10, "deregistered")
            await watcher.stop()
        assert registration.dropped == 0

    asyncio.run(scenario())

    # an instance's client, idle past the token's life, authenticates again on its next call
    http = EtcdHttp(target.address, timeout_s=3.0, auth=target.auth)
    lease = http.grant(5)
    token = http._token
    assert token and http.authentications == 1
    wait_for(lambda: _token_rejected(etcd.url, token), 10, "the token to expire", 1.5 * TOKEN_TTL_S)
    http.revoke(lease)
    assert http.authentications == 2
    http.close()


def test_wrong_or_missing_credentials_fail_clearly(
    etcd: LocalEtcd, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = _target(etcd, tmp_path, "not the password")
    with pytest.raises(EtcdAuthError, match=r"refused user 'kv'.*authentication failed"):
        EtcdHttp(wrong.address, timeout_s=3.0, auth=wrong.auth).grant(5)
    with pytest.raises(EtcdAuthError, match=r"give etcd://USER@HOST:PORT"):
        EtcdHttp(etcd.url, timeout_s=3.0).put(PREFIX + "x", b"{}", 0)  # auth is on, no credentials given

    info = InstanceInfo(instance_id="auth-1", role=Role.DECODE, url="http://127.0.0.1:9", model="m")
    registration = EtcdRegistration(wrong, info, interval_s=0.5)
    with caplog.at_level(logging.ERROR, logger="kvwire.discovery"):
        registration.tick()
    assert registration.dropped == 1 and "authentication failed" in registration.last_error
    assert any("not registered until the credentials are fixed" in r.getMessage() for r in caplog.records)

    async def router() -> None:
        watcher = EtcdDiscovery(Registry(ttl_s=100.0), wrong)
        await watcher.start()
        try:
            deadline = time.monotonic() + 10
            while "authentication failed" not in watcher.last_error:
                assert time.monotonic() < deadline, f"no auth error, last: {watcher.last_error!r}"
                await asyncio.sleep(0.05)
            assert watcher.stale and "refused user 'kv'" in watcher.last_error
        finally:
            await watcher.stop()

    asyncio.run(router())
