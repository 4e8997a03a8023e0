"""glibc malloc settings for CPU engine processes (decision 152): applied once per process by the
first CPU engine, skipped when the config says so or the C library has no mallopt."""

from __future__ import annotations

import ctypes
import platform

import pytest

from kvwire.engine import cpu_malloc, llm_engine
from support.engine_factories import make_engine


class _Mallopt:
    """A C library's mallopt as ctypes shows it (argtypes/restype settable); refuses ``refuse``."""

    def __init__(self, refuse: int | None = None) -> None:
        self.calls: list[tuple[int, int]] = []
        self.refuse = refuse

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 0 if param == self.refuse else 1


class _Libc:
    def __init__(self, mallopt: _Mallopt) -> None:
        self.mallopt = mallopt


def test_tune_malloc_applies_the_settings_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_malloc, "_applied", None)
    mallopt = _Mallopt()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _Libc(mallopt))
    assert cpu_malloc.tune_malloc() and cpu_malloc.tune_malloc()
    assert mallopt.calls == list(cpu_malloc.SETTINGS)  # set once, every setting
    assert dict(mallopt.calls)[cpu_malloc.M_MMAP_THRESHOLD] == 32 << 20  # glibc's largest allowed value


def test_a_refused_setting_or_no_mallopt_leaves_malloc_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_malloc, "_applied", None)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _Libc(_Mallopt(refuse=cpu_malloc.M_TOP_PAD)))
    assert not cpu_malloc.tune_malloc()
    monkeypatch.setattr(cpu_malloc, "_applied", None)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: object())  # no mallopt attribute
    assert not cpu_malloc.tune_malloc()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_accepts_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_malloc, "_applied", None)
    assert cpu_malloc.tune_malloc()


@pytest.mark.parametrize("tuning", [True, False])
def test_a_cpu_engine_tunes_malloc_unless_told_not_to(tuning: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(llm_engine, "tune_malloc", lambda: calls.append(1) or True)
    make_engine(cpu_malloc_tuning=tuning)
    assert calls == ([1] if tuning else [])
