"""The router's HTTP client of etcd's JSON gateway: one session, and the auth token it carries.

Credentials in the address (``etcd://USER@HOST:PORT``, decision 099): the first call authenticates
(``/v3/auth/authenticate``) and every call and the watch carry the token; a call answered "invalid
token" authenticates again and is retried once. Credentials etcd refuses raise
:class:`~kvwire.discovery.etcd_gateway.EtcdAuthError`. Every call has a deadline (``timeout_s``);
the watch has none (it lives as long as etcd keeps it open). Event-loop thread; created, used and
closed on the router's loop by :class:`~kvwire.router.etcd_watcher.EtcdWatcher`.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

import aiohttp

from kvwire.discovery.address import DiscoveryAddress
from kvwire.discovery.etcd_gateway import (
    AUTHENTICATE_PATH,
    EtcdTokenError,
    authenticate_body,
    check_answer,
    token_of,
)

CONNECT_TIMEOUT_S = 2.0
WATCH_PATH = "/v3/watch"


class EtcdClient:
    def __init__(self, target: DiscoveryAddress) -> None:
        self.target = target
        self._url = target.address
        self.session: aiohttp.ClientSession | None = None
        self.token: str | None = None  # etcd auth token (None: none yet; "": etcd's auth is off)

    def open(self) -> None:
        """The session (inside the running event loop); https verified against the address's CA."""
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S)
        ssl_context = self.target.ssl_context()
        connector = aiohttp.TCPConnector(ssl=ssl_context if ssl_context is not None else True)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=connector)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def post(self, path: str, body: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any]:
        """One gateway call; with credentials, authenticated (again, once, if etcd dropped the token)."""
        auth = self.target.auth
        if auth is not None and self.token is None:
            await self._authenticate(timeout_s)
        try:
            return await self._post_once(path, body, timeout_s)
        except EtcdTokenError:
            if auth is None:
                raise
            await self._authenticate(timeout_s)
            return await self._post_once(path, body, timeout_s)

    def watch(self, body: dict[str, Any]) -> AbstractAsyncContextManager[aiohttp.ClientResponse]:
        """The watch stream's response (``async with``), carrying the current token."""
        assert self.session is not None
        return self.session.post(self._url + WATCH_PATH, json=body, headers=self._headers())

    async def _post_once(self, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self.session is not None
        request_timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self.session.post(self._url + path, json=body, timeout=request_timeout,
                                     headers=self._headers()) as resp:
            return check_answer(path, resp.status, await resp.read())

    async def _authenticate(self, timeout_s: float) -> None:
        """A token for the address's user (:class:`EtcdAuthError` when etcd refuses it)."""
        assert self.session is not None and self.target.auth is not None
        self.token = None
        request_timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self.session.post(self._url + AUTHENTICATE_PATH, json=authenticate_body(self.target.auth),
                                     timeout=request_timeout) as resp:
            self.token = token_of(self.target.auth, self._url, resp.status, await resp.read())

    def _headers(self) -> dict[str, str]:
        return {"Authorization": self.token} if self.token else {}
