"""Sampling the next token from logits: greedy, temperature, top-k, top-p, per-request seeds.

Greedy rows take the argmax. The other rows are filtered together (temperature, then top-k, then
top-p over what is left) and drawn with ``torch.multinomial``: rows with their own seed from their own
generator (so a seeded request samples the same tokens whatever it is batched with), the rest in one
draw from the engine's generator.
"""

from __future__ import annotations

import torch

from kvwire.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for requests without a seed

    def new_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> list[int]:
        """logits: [N, vocab] fp32, one row per request -> N token ids (one host sync)."""
        tokens = logits.argmax(dim=-1)  # [N]; greedy rows keep this
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            probs = filtered_probs(logits[rows], [params[i] for i in rows])  # [R, vocab]
            shared = [j for j, i in enumerate(rows) if generators[i] is None]
            if shared:
                drawn = torch.multinomial(probs[shared], 1, generator=self.generator)[:, 0]
                tokens[[rows[j] for j in shared]] = drawn
            for j, i in enumerate(rows):
                gen = generators[i]
                if gen is not None:
                    tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        return [int(t) for t in tokens.tolist()]


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[R, vocab] logits -> probabilities after each row's temperature, top-k and top-p."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    sorted_logits, order = (logits / temperature).sort(dim=-1, descending=True)  # [R, vocab]
    rank = torch.arange(vocab, device=device)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p (the first always stays).
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.softmax(dim=-1))
