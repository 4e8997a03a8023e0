"""IncrementalDetokenizer with ``prior`` output (a migrated answer): the text continues exactly."""

from __future__ import annotations

from kvwire.engine.tokenizer import ByteTokenizer, IncrementalDetokenizer


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> str:
    return "".join(detok.step(ids[:i]) for i in range(1, len(ids) + 1))


def test_resuming_inside_a_multibyte_character_gives_the_same_text() -> None:
    tok = ByteTokenizer()
    ids = list("héllo wörld €".encode())
    whole = _stream(IncrementalDetokenizer(tok), ids)
    for split in range(1, len(ids)):
        first = IncrementalDetokenizer(tok)
        head = _stream(first, ids[:split])
        rest = _stream(IncrementalDetokenizer(tok, prior=ids[:split]), ids[split:])
        assert head + rest == whole, split


def test_output_text_excludes_the_prior_text() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, prior=list(b"abc"))
    detok.step(list(b"de"))
    assert detok.output_text == "de" and detok.text == "abcde"
