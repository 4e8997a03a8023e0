"""``Upstream.watched``: a read of an instance that stopped heartbeating fails as ``silent`` (the
dispatcher may re-dispatch it), unless the handler was cancelled at the same moment (its client went
away): then the cancellation propagates and nothing is re-dispatched for a client that is gone."""

from __future__ import annotations

import asyncio

import pytest

from kvwire.discovery import Heartbeat, InstanceInfo
from kvwire.protocol.kv_params import Role
from kvwire.router import relay
from kvwire.router.metrics import RouterMetrics
from kvwire.router.registry import Registry
from kvwire.router.relay import Upstream, UpstreamFailure


async def _watch(client_cancels_too: bool) -> BaseException:
    registry = Registry(ttl_s=10.0)
    registry.apply(Heartbeat(info=InstanceInfo(instance_id="d", role=Role.DECODE, url="http://127.0.0.1:1",
                                                model="m"),
                             seq=1))
    inst = registry.get("d")
    assert inst is not None
    upstream = Upstream(registry, RouterMetrics(), 1.0, 10.0)
    never: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()  # the answer never comes
    task = asyncio.current_task()
    assert task is not None

    def silent(_: object) -> bool:  # the check finds the instance gone
        if client_cancels_too:
            task.cancel()  # the client's cancellation, in the same loop iteration as the check's
        return True

    upstream._silent = silent  # type: ignore[method-assign]
    try:
        await upstream.watched(inst, "decode", never)
    except (UpstreamFailure, asyncio.CancelledError) as exc:
        return exc
    finally:
        await upstream.close()
    raise AssertionError("watched returned")


@pytest.mark.parametrize("client_cancels_too", [False, True])
def test_a_silent_instance_fails_the_read_unless_the_client_went_away(
    client_cancels_too: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay, "SILENCE_CHECK_S", 0.01)

    async def main() -> BaseException:
        try:
            return await _watch(client_cancels_too)
        except asyncio.CancelledError as exc:  # raised out of _watch's finally: the task stays cancelled
            return exc

    outcome = asyncio.run(main())
    if client_cancels_too:
        assert isinstance(outcome, asyncio.CancelledError), outcome
    else:
        assert isinstance(outcome, UpstreamFailure) and outcome.kind == "silent", outcome
