"""Build a tiny random-weight Llama (fp32) with a locally trained tokenizer, loadable by vLLM offline.

Run with the vLLM venv's python: ``python tests/vllm/tiny_llama.py OUT_DIR``. Idempotent (a stamp
file marks a complete build). head_dim 32: vLLM's CPU attention needs >= 32. The weights are drawn
with a large init range so that greedy logits have clear margins (no near-ties that a different
batch composition could flip), which keeps "P/D output == plain output" a sharp check.
"""

from __future__ import annotations

import sys
from pathlib import Path

VOCAB_SIZE = 512
STAMP = "kvwire-tiny-llama-v1"


def _corpus() -> list[str]:
    words = [
        "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "kv", "cache", "prefill", "decode",
        "token", "block", "layer", "transfer", "router", "engine", "tensor", "stream", "batch", "model",
    ]
    lines = []
    for i in range(400):
        lines.append(" ".join(words[(i * k + k * k) % len(words)] for k in range(1, 12)) + f" {i}")
    return lines


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)


def build_model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    stamp = out / STAMP
    if stamp.exists():
        return 0
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    build_model(out)
    stamp.touch()
    print(f"tiny llama written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
