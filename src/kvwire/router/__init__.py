"""The OpenAI-compatible front door (imports no torch).

``config`` (RouterConfig, Policy) · ``registry`` (liveness: heartbeats, epochs, TTL sweeper, mark-out) ·
``listener`` (ZeroMQ discovery socket -> registry; disconnect detection) · ``policy`` (pure pick functions) ·
``selection`` (plan colocated vs P/D, per-role turns, in-flight accounting) · ``request`` (client body) ·
``upstream`` (HTTP calls to instances, failures classified) · ``proxy`` (dispatch: colocated, P/D push/pull) ·
``splice`` (opt-in: P's first token streamed at once) · ``client_stream`` (metered SSE to the client) ·
``metrics`` (Prometheus, per app) · ``app`` (aiohttp server) · ``cli`` (``kvwire router``).
The instance side of discovery is :mod:`kvwire.discovery`.
"""
