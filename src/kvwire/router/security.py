"""The router's side of authentication: which credentials go to instances.

Clients authenticate to the router with its own keys (:mod:`kvwire.http.front_door`); instances are a separate
trust boundary. The router sends ``RouterConfig.instance_api_key`` to every instance. Without one, it
passes the client's ``Authorization`` header on only when it has no keys of its own (a router in
front of instances that check keys themselves, e.g. vLLM's ``--api-key``); a client's key for the
router is never shown to instances.
"""

from __future__ import annotations

from kvwire.http.front_door import bearer_header
from kvwire.router.config import RouterConfig


def instance_headers(forwarded: dict[str, str], cfg: RouterConfig) -> dict[str, str]:
    """``forwarded`` (the client's headers the router passes on) with the instance credentials."""
    headers = {k: v for k, v in forwarded.items() if k.lower() != "authorization"}
    if cfg.instance_api_key:
        headers.update(bearer_header(cfg.instance_api_key))
    elif not cfg.api_keys.enabled and "Authorization" in forwarded:
        headers["Authorization"] = forwarded["Authorization"]
    return headers
