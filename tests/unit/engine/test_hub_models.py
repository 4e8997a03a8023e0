"""Hugging Face model ids resolved offline from a populated cache (decision 122): a safetensors repo
with tied embeddings stored under either name loads and generates what transformers does; a GGUF
repo by vLLM's ``ORG/NAME:QUANT`` and by ``gguf_file``; ``revision``; a clear error when offline and
not cached; HF_HUB_OFFLINE=1 from the environment in a fresh process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
import transformers  # a dev dependency: if it is missing this module fails, it is never skipped
from safetensors.torch import save_file, save_model

import kvwire
from kvwire import hub
from kvwire.engine.config import EngineConfig
from kvwire.engine.loader import load_model
from kvwire.errors import ModelLoadError
from support.gguf_files import write_tiny_llama
from support.hf_models import hf_greedy, save_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _snapshot(cache: Path, repo: str, commit: str = COMMIT, ref: str = "main") -> Path:
    """An empty snapshot folder of ``repo`` laid out as huggingface_hub's cache keeps it."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    return snap


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import huggingface_hub.constants as constants

    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return root


def _tied_llama(out: Path, keep: str) -> Any:
    torch.manual_seed(5)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, bos_token_id=0,
        eos_token_id=1, tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    config.save_pretrained(out)
    save_tokenizer(out)
    if keep == "lm_head":  # what safetensors.torch.save_model writes for tied weights
        save_model(model, str(out / "model.safetensors"))
    else:
        state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(state, str(out / "model.safetensors"))
    return model


@pytest.mark.parametrize("keep", ["lm_head", "embed_tokens"])
def test_tied_checkpoint_from_the_cache_matches_transformers(cache: Path, keep: str) -> None:
    snap = _snapshot(cache, "test-org/tiny-tied")
    reference = _tied_llama(snap, keep)
    from safetensors import safe_open

    with safe_open(str(snap / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    assert ("lm_head.weight" in stored) == (keep == "lm_head")  # one tensor, under either name
    assert ("model.embed_tokens.weight" in stored) == (keep == "embed_tokens")
    llm = kvwire.LLM(model="test-org/tiny-tied", dtype="float32", block_size=8, num_kv_blocks=32)
    prompt = llm.tokenizer.encode("The quick brown")
    out = llm.generate(["The quick brown"], kvwire.SamplingParams(max_tokens=8, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(reference, prompt, 8)


def test_gguf_repo_by_quant_suffix_file_and_revision(cache: Path) -> None:
    snap = _snapshot(cache, "test-org/tiny-GGUF")
    for quant in ("F32", "Q8_0"):
        qtype = getattr(gguf.GGMLQuantizationType, quant)
        write_tiny_llama(snap / f"tiny-{quant}.gguf", qtype)
    assert hub.resolve("test-org/tiny-GGUF:q8_0") == snap / "tiny-Q8_0.gguf"  # vLLM's syntax
    assert hub.resolve("test-org/tiny-GGUF", gguf_file="tiny-F32.gguf") == snap / "tiny-F32.gguf"
    with pytest.raises(ModelLoadError, match="2 GGUF files"):
        hub.resolve("test-org/tiny-GGUF")  # ambiguous: say how to choose
    with pytest.raises(ModelLoadError, match=r"0 \.gguf files match"):
        hub.resolve("test-org/tiny-GGUF:Q4_K_M")
    other = _snapshot(cache, "test-org/tiny-GGUF", commit="f" * 40, ref="v2")
    write_tiny_llama(other / "tiny-Q8_0.gguf", gguf.GGMLQuantizationType.Q8_0, seed=9)
    assert hub.resolve("test-org/tiny-GGUF:Q8_0", revision="v2") == other / "tiny-Q8_0.gguf"
    loaded = load_model(EngineConfig(model="test-org/tiny-GGUF:Q8_0"))
    assert loaded.model.config.num_layers == 2


def test_offline_and_not_cached_is_a_clear_error(cache: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        load_model(EngineConfig(model="HuggingFaceTB/SmolLM2-135M-Instruct"))
    with pytest.raises(ModelLoadError, match="neither a model name"):
        load_model(EngineConfig(model="no/such/thing"))
    assert hub.is_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct") and not hub.is_repo_id("tiny")


def test_tokenizer_from_a_model_id(cache: Path, tmp_path: Path) -> None:
    snap = _snapshot(cache, "test-org/tokenizer-only")
    save_tokenizer(snap)
    assert hub.resolve_tokenizer("test-org/tokenizer-only") == snap
    assert hub.resolve_tokenizer(str(tmp_path)) == tmp_path  # a local directory is itself


def test_hf_hub_offline_from_the_environment(tmp_path: Path) -> None:
    """A fresh process with HF_HOME and HF_HUB_OFFLINE=1 resolves the cached id (what `kvwire serve
    --model ORG/NAME` does) without any network."""
    snap = _snapshot(tmp_path / "hf" / "hub", "test-org/tiny-GGUF")
    write_tiny_llama(snap / "tiny-Q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    code = "from kvwire import hub; print(hub.resolve('test-org/tiny-GGUF'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == snap / "tiny-Q8_0.gguf"
    shutil.rmtree(tmp_path / "hf")
