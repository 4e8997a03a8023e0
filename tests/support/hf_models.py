"""Small Hugging Face Llama models and tokenizers built in a test, and greedy generation with
transformers: the oracle of the built-in engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers  # a dev dependency: if it is missing this module fails, it is never skipped


def save_tokenizer(model_dir: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>"]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(model_dir)
    return fast


def hf_greedy(model: Any, prompt_ids: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return [int(t) for t in out[0, len(prompt_ids) :]]


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill and decode run on different machines; the KV cache moves between them.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Hello world! How are you today? I am fine, thank you.",
] * 20


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
