"""A Hugging Face cache built in a test, offline: huggingface_hub resolves model ids from it and
never touches the network (``HF_HUB_OFFLINE``), the way a host without internet access runs."""

from __future__ import annotations

from pathlib import Path

import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def offline_cache(monkeypatch: pytest.MonkeyPatch, root: Path) -> Path:
    """Point huggingface_hub (this process) at an empty cache under ``root``, offline."""
    import huggingface_hub.constants as constants

    cache = root / "hub"
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def snapshot(cache: Path, repo: str, commit: str = COMMIT, ref: str = "main") -> Path:
    """An empty snapshot folder of ``repo`` laid out as huggingface_hub's cache keeps it
    (``models--ORG--NAME/{refs/REF, snapshots/COMMIT/}``); a commit id as ``ref`` needs no ref file."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    if ref != commit:
        (root / "refs" / ref).write_text(commit)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    return snap
