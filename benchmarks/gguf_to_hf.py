"""Write a plain fp32 Hugging Face directory (config.json, model.safetensors, tokenizer files) from a
Llama GGUF file, with ``transformers`` (needs ``gguf`` and ``accelerate``).

transformers refuses ``save_pretrained`` of a GGUF-loaded model, so the state dict is saved with
safetensors and the config and tokenizer by hand. The tied LM head is left out of the file (the
config says ``tie_word_embeddings``), as HF checkpoints do.

Usage: ``python benchmarks/gguf_to_hf.py [GGUF|smollm2-135m] OUT_DIR``
"""

from __future__ import annotations

import sys
from pathlib import Path


def convert(gguf_path: Path, out_dir: Path) -> Path:
    import torch
    import transformers
    from safetensors.torch import save_file

    if (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    kw = {"gguf_file": gguf_path.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
    auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kw)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if hasattr(model.config, "quantization_config"):  # the weights saved are plain fp32
        del model.config.quantization_config
    model.config.to_json_file(str(out_dir / "config.json"))
    tokenizer.save_pretrained(str(out_dir))
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def resolve_gguf(name: str) -> Path:
    """A packaged model name (``smollm2-135m``) or a path."""
    if name.endswith(".gguf"):
        return Path(name)
    from kvwire.engine.models.presets import PACKAGED_MODELS

    return PACKAGED_MODELS[name].path(name)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(convert(resolve_gguf(sys.argv[1]), Path(sys.argv[2])))
