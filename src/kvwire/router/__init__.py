"""The OpenAI-compatible front door (imports no torch).

The request path, in order: ``app`` (aiohttp server, errors -> HTTP once, credentials for instances)
· ``request`` (the client's body, validated once; the ledger of a stream that may migrate) ·
``dispatcher`` (one request's whole loop: plan, attempt, retry, re-dispatch, migrate; one P/D
attempt in push or pull mode, its ``kv_transfer_params`` and bodies) · ``selection`` (policies,
picks, KV-aware P/D planning, the prompt's tokens) · ``relay`` (calls to instances with failures
classified, the client's metered stream, P's first token spliced onto D's) · ``registry``
(liveness: heartbeats, epochs, TTL, mark-out; and the KV index of who caches which block).
Around it: ``config`` (RouterConfig, Policy) · ``metrics`` (Prometheus, per app) · ``listener``
(ZeroMQ discovery socket -> registry) · ``etcd_watcher`` (etcd discovery: ``etcd_client``,
``etcd_records``, ``etcd_probe``) · ``sweeper`` · ``vllm_api`` · ``cli`` (``kvwire router``).
The instance side of discovery is :mod:`kvwire.discovery`.
"""
