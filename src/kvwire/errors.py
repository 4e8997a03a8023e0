"""One exception hierarchy for kvwire.

Every error kvwire raises derives from :class:`KvwireError`. Where a stdlib exception has the same
meaning, the kvwire error inherits it too (``TransferTimeout`` is a ``TimeoutError``), so callers can
catch either. Errors are converted to an HTTP status or a FAILED transfer state once, at the outermost
loop, and logged there.
"""

from __future__ import annotations


class KvwireError(Exception):
    """Base of every kvwire error."""


class ConfigError(KvwireError, ValueError):
    """A configuration value is missing, out of range or inconsistent (raised at start-up)."""


# --- transfer -------------------------------------------------------------------------------------


class TransferError(KvwireError):
    """A KV transfer could not complete. ``transfer_id`` names it when known."""

    def __init__(self, message: str, transfer_id: str | None = None) -> None:
        super().__init__(message)
        self.transfer_id = transfer_id


class TransferTimeout(TransferError, TimeoutError):
    """The transfer's deadline passed before every layer was acknowledged."""


class PeerLostError(TransferError, ConnectionError):
    """The peer died, restarted (new epoch) or became unreachable."""


# --- wire protocol ----------------------------------------------------------------------------------


class ProtocolError(KvwireError):
    """A message was malformed, of an unknown type or of an unsupported version."""


class AuthenticationError(ProtocolError, PermissionError):
    """A peer could not prove the shared secret."""


class ForbiddenError(KvwireError, PermissionError):
    """A request asks for something its sender may not (becomes HTTP 403). ``reason`` is a short
    metric label (e.g. ``unsigned``, ``bad_signature``, ``expired``)."""

    def __init__(self, message: str, reason: str = "forbidden") -> None:
        super().__init__(message)
        self.reason = reason


# --- engine / serving -------------------------------------------------------------------------------


class EngineError(KvwireError):
    """The engine failed internally."""


class EngineStalled(EngineError):
    """The engine thread completed no step within the stall timeout while requests waited for it;
    they are failed (HTTP 503) and the server is unhealthy until the engine makes progress again."""


class RankLost(EngineError):
    """A tensor-parallel rank of the engine exited, failed or stopped answering. The other ranks
    cannot compute without its heads: every request of the engine ended with this error, its blocks
    and transfers are released, and the engine refuses all further work (the instance answers 503
    ``instance_lost`` and exits non-zero so that its supervisor restarts it; decision 085)."""


# Error codes of an instance's 503 that says it serves nothing more: a router takes it out of routing.
INSTANCE_LOST = "instance_lost"  # the engine lost a tensor-parallel rank (RankLost); the process exits
INSTANCE_STOPPING = "instance_stopping"  # the server is shutting down
INSTANCE_GONE_CODES = frozenset({INSTANCE_LOST, INSTANCE_STOPPING})
EXIT_RANK_LOST = 3  # exit code of ``kvwire serve`` after its engine lost a tensor-parallel rank


class ServerShuttingDown(KvwireError):
    """The server is stopping; in-flight requests were aborted (becomes HTTP 503)."""


class InvalidRequestError(KvwireError, ValueError):
    """A client request is invalid (becomes HTTP 400)."""


class ModelLoadError(KvwireError):
    """A model directory or preset could not be loaded."""


# --- router -----------------------------------------------------------------------------------------


class RouterError(KvwireError):
    """The router could not serve a request."""


class NoInstanceError(RouterError):
    """No live instance serves the role (becomes HTTP 503)."""


class UpstreamError(RouterError):
    """An upstream instance answered with an error or could not be reached."""

    def __init__(self, message: str, status: int = 502, kind: str = "error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


# --- local cluster ------------------------------------------------------------------------------------


class ClusterError(KvwireError):
    """A local cluster (``kvwire up``) could not start or lost a process."""


# --- HTTP clients -----------------------------------------------------------------------------------


class ClientWriteTimeout(KvwireError, ConnectionResetError):
    """A client stopped reading: one write to it did not complete within the write deadline. The
    connection is aborted and the request handled like a client disconnect."""
