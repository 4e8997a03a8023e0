"""The Python API of a kvwire cluster on Ray (``kvwire up --ray`` and ``kvwire scale`` use it).

::

    spec = RaySpec(ClusterSpec(num_prefill=1, num_decode=2, model="tiny"), address="auto",
                   prefill=Placement(resources=(("pool_p", 1.0),)),
                   decode=Placement(resources=(("pool_d", 1.0),)))
    with RayCluster(spec) as cluster:      # router + 1P2D as Ray actors, ready
        print(cluster.router_url)
        cluster.scale(Role.DECODE, 3)       # one more decode instance, registered
        cluster.scale(Role.DECODE, 1)       # two drained and ended
    # every actor, placement group and kvwire process is gone

``RayCluster.attach(name, address)`` gives a handle on a cluster another driver started (it stays up
when that handle is dropped). Connecting: ``ray.init(address)`` unless this process is already
connected. Decision 120.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from types import TracebackType
from typing import Any

import ray

from kvwire.cluster.ray_controller import ClusterController
from kvwire.cluster.ray_spec import RAY_NAMESPACE, RaySpec
from kvwire.errors import ClusterError
from kvwire.protocol.kv_params import Role

_Controller = ray.remote(ClusterController)


def connect(address: str) -> bool:
    """``ray.init`` unless connected already; True when this call connected."""
    if ray.is_initialized():
        return False
    ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=True)
    return True


def credentials(spec: RaySpec) -> dict[str, str]:
    """What every process gets in its environment: the API key (given, else $KVWIRE_API_KEY) and a
    shared secret (given, else $KVWIRE_SECRET, else a fresh one for this cluster: the processes run
    on several hosts, so their P/D parameters and heartbeats are signed)."""
    api_key = spec.cluster.api_key or os.environ.get("KVWIRE_API_KEY")
    secret = spec.cluster.secret or os.environ.get("KVWIRE_SECRET") or secrets.token_urlsafe(32)
    return {"KVWIRE_SECRET": secret, **({"KVWIRE_API_KEY": api_key} if api_key else {})}


class RayCluster:
    """See the module docstring. Context manager; :meth:`stop` is idempotent."""

    def __init__(self, spec: RaySpec) -> None:
        self.spec = spec
        self._controller: Any = None
        self._owner = True  # started here (stop ends it) or attached (stop ends it too, when asked)
        self._connected_here = False
        self.state: dict[str, Any] = {}

    @classmethod
    def attach(cls, name: str, address: str = "auto") -> RayCluster:
        """A handle on the running cluster ``name`` (ClusterError when there is none)."""
        from kvwire.cluster.local import ClusterSpec

        handle = cls(RaySpec(ClusterSpec(), address=address, name=name))
        handle._connected_here = connect(address)
        handle._owner = False
        try:
            handle._controller = ray.get_actor(handle.spec.controller_name, namespace=RAY_NAMESPACE)
        except ValueError as exc:
            handle.close()
            raise ClusterError(f"no kvwire cluster named {name!r} on this Ray cluster") from exc
        handle.state = handle.status()
        return handle

    def start(self) -> RayCluster:
        """Create the controller and start everything; ClusterError when it is not ready in time."""
        self._connected_here = connect(self.spec.address)
        self._controller = _Controller.options(
            name=self.spec.controller_name, namespace=RAY_NAMESPACE, num_cpus=0, max_restarts=0,
        ).remote(self.spec, credentials(self.spec))
        try:
            self.state = ray.get(self._controller.start.remote(), timeout=self._start_timeout_s())
        except BaseException:
            # The controller stops what it started when start fails by itself; on Ctrl-C or a timeout
            # it is still busy starting: ending it ends every actor it owns (their children with them).
            self._kill()
            raise
        return self

    def _start_timeout_s(self) -> float:
        return 2 * self.spec.cluster.start_timeout_s + 60  # placement, then processes

    @property
    def router_url(self) -> str:
        return str(self.state.get("router_url", ""))

    def status(self) -> dict[str, Any]:
        """``router_url`` and ``processes``: name -> role, node, pids, alive, restarted."""
        self.state = ray.get(self._controller.status.remote(), timeout=60)
        return self.state

    def scale(self, role: Role | str, count: int) -> dict[str, Any]:
        """Bring ``role`` to ``count`` instances: new ones registered and healthy, removed ones
        drained (their requests in flight finish) and ended. Returns the status."""
        timeout_s = self._start_timeout_s() + self.spec.drain_timeout_s
        self.state = ray.get(self._controller.scale.remote(role, count), timeout=timeout_s)
        return self.state

    def stop(self) -> None:
        """Stop every process and end the controller (also on an attached handle)."""
        if self._controller is not None:
            # the controller gone or stuck: ending it (below) ends what it owns
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
                ray.get(self._controller.stop.remote(), timeout=4 * self.spec.cluster.stop_grace_s + 60)
        self._kill()

    def _kill(self) -> None:
        if self._controller is not None:
            ray.kill(self._controller, no_restart=True)
            self._controller = None
        self.close()

    def close(self) -> None:
        """Drop this handle (an attached cluster keeps running); disconnect if we connected."""
        self._controller = None
        if self._connected_here:
            ray.shutdown()
            self._connected_here = False

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
