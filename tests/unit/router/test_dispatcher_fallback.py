"""--pd-fallback (decision 124): with no live P for a model, D serves alone (default) or the router
refuses; /v1/models lists exactly the models a request could be served on now."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, Counter

from kvwire.discovery import Heartbeat, InstanceInfo
from kvwire.errors import ConfigError, NoInstanceError
from kvwire.protocol.kv_params import Role
from kvwire.router.config import PdFallback, Policy, RouterConfig
from kvwire.router.dispatcher import FallbackNotice
from kvwire.router.registry import Registry
from kvwire.router.selection import Plan, Selector

P, D, B = Role.PREFILL, Role.DECODE, Role.BOTH


def _registry(*specs: tuple[str, Role, str]) -> Registry:
    reg = Registry(ttl_s=10)
    for ident, role, model in specs:
        info = InstanceInfo(instance_id=ident, role=role, url=f"http://h/{ident}", model=model)
        reg.apply(Heartbeat(info=info, seq=1))
    return reg


def test_decode_alone_is_planned_only_when_no_prefill_or_both_is_live() -> None:
    assert Selector(_registry(("d", D, "m")), Policy.RANDOM).plan("m") is Plan.DECODE_ALONE
    assert Selector(_registry(("d", D, "m")), Policy.RANDOM).plan(None) is Plan.DECODE_ALONE
    assert Selector(_registry(("p", P, "m"), ("d", D, "m")), Policy.RANDOM).plan("m") is Plan.DISAGGREGATED
    assert Selector(_registry(("b", B, "m"), ("d", D, "m")), Policy.RANDOM).plan("m") is Plan.COLOCATED
    # P of another model does not make a P/D pair for this one
    assert Selector(_registry(("p", P, "x"), ("d", D, "m")), Policy.RANDOM).plan("m") is Plan.DECODE_ALONE


def test_fallback_error_refuses_with_a_message_naming_the_flag() -> None:
    sel = Selector(_registry(("d", D, "m")), Policy.RANDOM, decode_alone=False)
    with pytest.raises(NoInstanceError, match=r"no live prefill instance.*--pd-fallback error"):
        sel.plan("m")
    with pytest.raises(NoInstanceError, match="no live decode"):  # P alone never serves
        Selector(_registry(("p", P, "m")), Policy.RANDOM).plan("m")


@pytest.mark.parametrize("decode_alone", [True, False])
def test_servable_models_match_what_plan_serves(decode_alone: bool) -> None:
    reg = _registry(("p1", P, "pd"), ("d1", D, "pd"), ("b", B, "solo"), ("d2", D, "d_only"),
                    ("p3", P, "p_only"))
    sel = Selector(reg, Policy.RANDOM, decode_alone=decode_alone)
    expected = ["d_only", "pd", "solo"] if decode_alone else ["pd", "solo"]
    assert sel.servable_models() == expected
    for model in ("pd", "solo", "d_only", "p_only"):
        try:
            sel.plan(model)
            served = True
        except NoInstanceError:
            served = False
        assert served == (model in expected), model


def test_notice_counts_every_request_and_warns_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    counter = Counter("fallback_test", "test", registry=CollectorRegistry())
    notice = FallbackNotice(counter, interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="kvwire.router.dispatcher"):
        for _ in range(5):
            notice.served_alone("m")
        notice.served_alone("other")
    assert counter._value.get() == 6
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "'m'" in warnings[0] and "'other'" in warnings[1]


def test_config_default_is_colocated_and_rejects_a_string() -> None:
    assert RouterConfig().pd_fallback is PdFallback.COLOCATED
    with pytest.raises(ConfigError, match="pd_fallback"):
        RouterConfig(pd_fallback="error")  # type: ignore[arg-type]
