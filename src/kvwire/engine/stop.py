"""When a request stops: stop tokens, EOS, stop strings, max_tokens, the model length."""

from __future__ import annotations

from kvwire.engine.request import Request, RequestStatus


def check_stop(
    req: Request, token: int, eos_token_ids: frozenset[int], max_model_len: int
) -> tuple[RequestStatus | None, str]:
    """Called after ``token`` was appended to ``req.output_token_ids``. Returns the finish status
    (None = continue) and the text this token adds to the output (cut before a stop string; a stop
    token adds no text)."""
    p = req.params
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        return RequestStatus.FINISHED_STOPPED, req.detokenizer.step(req.output_token_ids[:-1], final=True)
    length_done = len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= max_model_len
    detok = req.detokenizer
    emitted = len(detok.text)
    new_text = detok.step(req.output_token_ids, final=length_done)
    if p.stop and new_text:
        window_start = max(0, emitted - max(len(s) for s in p.stop) + 1)
        hits = [i for i in (detok.text.find(s, window_start) for s in p.stop) if i >= 0]
        if hits:
            cut = min(hits)
            detok.text = detok.text[:cut]
            return RequestStatus.FINISHED_STOPPED, new_text[: max(0, cut - emitted)]
    if length_done:
        return RequestStatus.FINISHED_LENGTH, new_text
    return None, new_text
