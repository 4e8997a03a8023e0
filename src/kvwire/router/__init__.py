"""The OpenAI-compatible front door (imports no torch).

``config`` (RouterConfig, Policy) · ``registry`` (liveness: heartbeats, epochs, TTL sweeper, mark-out) ·
``listener`` (ZeroMQ discovery socket -> registry; disconnect detection) · ``etcd_watcher`` (etcd
discovery: ``etcd_client``, ``etcd_records``, ``etcd_probe``) · ``policy`` (pure pick functions) ·
``selection`` (plan colocated vs P/D, per-role turns, in-flight accounting) · ``request`` (client body) ·
``upstream`` (HTTP calls to instances, failures classified) · ``dispatcher`` (one request's whole loop:
plan, attempt, retry, re-dispatch, migrate) · ``pd_push`` / ``pd_pull`` (one P/D attempt) · ``relay``
(one instance's answer to the client) · ``splice`` (P's first token streamed at once) ·
``stream_ledger`` (what a streaming client was sent) · ``continuation`` (which failures move, how a
move ends) · ``client_stream`` (metered SSE to the client) · ``metrics`` (Prometheus, per app) ·
``app`` (aiohttp server) · ``cli`` (``kvwire router``).
The instance side of discovery is :mod:`kvwire.discovery`.
"""
