"""Sampling the next token from logits: greedy, temperature, top-k, top-p, per-request seeds."""

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
        for row, (p, gen) in enumerate(zip(params, generators, strict=False)):
            if not p.greedy:
                probs = _probs(logits[row], p)
                tokens[row] = torch.multinomial(probs, 1, generator=gen or self.generator)[0]
        return [int(t) for t in tokens.tolist()]


def _probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[vocab] logits -> probabilities after temperature, top-k and top-p (nucleus) filtering."""
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p (the first always stays).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= p.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(dim=-1)
