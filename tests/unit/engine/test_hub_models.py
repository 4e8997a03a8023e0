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
from kvwire.engine.models.presets import PACKAGED_MODELS
from kvwire.errors import ModelLoadError
from support.gguf_files import write_tiny_llama
from support.hf_cache import offline_cache, snapshot
from support.hf_models import hf_greedy, save_tokenizer


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return offline_cache(monkeypatch, tmp_path)


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
    snap = snapshot(cache, "test-org/tiny-tied")
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
    snap = snapshot(cache, "test-org/tiny-GGUF")
    for quant in ("F32", "Q8_0"):
        qtype = getattr(gguf.GGMLQuantizationType, quant)
        write_tiny_llama(snap / f"tiny-{quant}.gguf", qtype)
    assert hub.resolve("test-org/tiny-GGUF:q8_0") == snap / "tiny-Q8_0.gguf"  # vLLM's syntax
    assert hub.resolve("test-org/tiny-GGUF", gguf_file="tiny-F32.gguf") == snap / "tiny-F32.gguf"
    with pytest.raises(ModelLoadError, match="2 GGUF files"):
        hub.resolve("test-org/tiny-GGUF")  # ambiguous: say how to choose
    with pytest.raises(ModelLoadError, match=r"0 \.gguf files match"):
        hub.resolve("test-org/tiny-GGUF:Q4_K_M")
    other = snapshot(cache, "test-org/tiny-GGUF", commit="f" * 40, ref="v2")
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
    snap = snapshot(cache, "test-org/tokenizer-only")
    save_tokenizer(snap)
    assert hub.resolve_tokenizer("test-org/tokenizer-only") == snap
    assert hub.resolve_tokenizer(str(tmp_path)) == tmp_path  # a local directory is itself


def test_hf_hub_offline_from_the_environment(tmp_path: Path) -> None:
    """A fresh process with HF_HOME and HF_HUB_OFFLINE=1 resolves the cached id (what `kvwire serve
    --model ORG/NAME` does) without any network."""
    snap = snapshot(tmp_path / "hf" / "hub", "test-org/tiny-GGUF")
    write_tiny_llama(snap / "tiny-Q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    code = "from kvwire import hub; print(hub.resolve('test-org/tiny-GGUF'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == snap / "tiny-Q8_0.gguf"
    shutil.rmtree(tmp_path / "hf")


def test_packaged_model_falls_back_to_the_same_file_on_the_hub(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """smollm2-135m without its package: the file it bundles, from the Hugging Face cache (online:
    downloaded there first), pinned to the commit the package names."""
    import importlib.metadata

    def absent(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    entry = PACKAGED_MODELS["smollm2-135m"]
    assert entry.hub_revision is not None
    snap = snapshot(cache, entry.hub_repo, commit=entry.hub_revision, ref=entry.hub_revision)
    write_tiny_llama(snap / entry.hub_file)
    assert entry.path("smollm2-135m") == snap / entry.hub_file


def test_router_tokenizer_from_a_model_id(cache: Path) -> None:
    """The router's --tokenizer ORG/NAME (KV-aware routing) comes from the same cache."""
    from kvwire.router.selection import PromptTokenizer

    save_tokenizer(snapshot(cache, "test-org/tok"))
    tok = PromptTokenizer("test-org/tok").tokenizer("")
    assert tok is not None and tok.encode("The quick brown")[0] == 0  # the BOS of save_tokenizer
