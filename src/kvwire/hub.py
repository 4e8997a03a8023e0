"""Hugging Face model ids as vLLM users write them, resolved through ``huggingface_hub``'s cache.

``ORG/NAME`` (a safetensors repo: config, tokenizer and weights are fetched), ``ORG/NAME-GGUF`` with
``gguf_file`` (one file of a GGUF repo), or vLLM's ``ORG/NAME-GGUF:QUANT`` (the repo's one ``.gguf``
whose name carries ``QUANT``, e.g. ``Q4_K_M``); a GGUF repo holding a single ``.gguf`` needs neither.
``revision`` is a branch, tag or commit. The token, the cache location and offline mode are
``huggingface_hub``'s own (``HF_TOKEN`` or ``huggingface-cli login``, ``HF_HOME``/``HF_HUB_CACHE``,
``HF_HUB_OFFLINE=1``); offline, only what the cache holds resolves, and anything else is a
:class:`~kvwire.errors.ModelLoadError` that says so. No torch here: the router may resolve tokenizers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kvwire.errors import ModelLoadError

# ORG/NAME with Hugging Face's allowed characters; an optional ":QUANT" suffix (vLLM's GGUF syntax)
_REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96})(?::(?P<quant>[\w.-]{1,64}))?$")
# What a safetensors checkpoint directory needs (the engine reads nothing else)
_CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
_TOKENIZER_FILES = ["*.json", "*.jinja", "tokenizer.model"]


def is_repo_id(model: str) -> bool:
    """``ORG/NAME`` or ``ORG/NAME:QUANT`` that is not a local path."""
    return _REPO_ID.match(model) is not None and not Path(model).exists()


def resolve(model: str, revision: str | None = None, gguf_file: str | None = None) -> Path:
    """The local checkpoint directory (safetensors repo) or ``.gguf`` file for ``model``.

    Downloads what the cache lacks unless offline. Raises ModelLoadError: offline and not cached,
    unknown repo or revision, gated or private without a token, no usable weights, an ambiguous GGUF
    choice."""
    match = _REPO_ID.match(model)
    if match is None:
        raise ModelLoadError(f"{model!r} is not a Hugging Face model id (ORG/NAME or ORG/NAME:QUANT)")
    repo, quant = match.group("repo"), match.group("quant")
    if gguf_file is not None:
        return _download_file(repo, gguf_file, revision)
    files = _repo_files(repo, revision)
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if quant is not None:
        picked = [f for f in ggufs if quant.lower() in Path(f).name.lower()]
        if len(picked) != 1:
            raise ModelLoadError(f"{repo}: {len(picked)} .gguf files match {quant!r} (of {ggufs}); "
                                 "name one with --gguf-file")
        return _download_file(repo, picked[0], revision)
    if any(f.endswith(".safetensors") for f in files):
        return _snapshot(repo, revision, _CHECKPOINT_FILES)
    if len(ggufs) == 1:
        return _download_file(repo, ggufs[0], revision)
    if ggufs:
        raise ModelLoadError(f"{repo} holds {len(ggufs)} GGUF files {ggufs}: pick one with "
                             f"--gguf-file FILE or {repo}:QUANT (e.g. {repo}:Q4_K_M)")
    raise ModelLoadError(f"{repo} holds neither *.safetensors nor *.gguf weights")


def resolve_tokenizer(ref: str, revision: str | None = None) -> Path:
    """A tokenizer directory: ``ref`` itself when it is a local directory, else the tokenizer files
    of the Hugging Face repo ``ref`` (cache, download, offline rules as :func:`resolve`)."""
    if Path(ref).is_dir():
        return Path(ref)
    match = _REPO_ID.match(ref)
    if match is None or match.group("quant") is not None:
        raise ModelLoadError(f"tokenizer {ref!r} is neither a local directory nor a Hugging Face model id")
    return _snapshot(ref, revision, _TOKENIZER_FILES)


# --- huggingface_hub, with its errors made ours ------------------------------------------------


def _hub() -> Any:
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
    except ImportError as exc:  # a declared dependency; say so if an install lacks it
        raise ModelLoadError("model ids need huggingface_hub (pip install huggingface_hub)") from exc
    return huggingface_hub


def _offline() -> bool:
    return bool(_hub().constants.HF_HUB_OFFLINE)


def _repo_files(repo: str, revision: str | None) -> list[str]:
    """The repo's files: listed by the Hub, or (offline) those of the cached snapshot."""
    hub = _hub()
    if _offline():
        root = Path(_call(hub.snapshot_download, repo, revision, local_files_only=True))
        return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    return list(_call(hub.HfApi().list_repo_files, repo, revision))


def _snapshot(repo: str, revision: str | None, patterns: list[str]) -> Path:
    return Path(_call(_hub().snapshot_download, repo, revision, allow_patterns=patterns))


def _download_file(repo: str, filename: str, revision: str | None) -> Path:
    return Path(_call(_hub().hf_hub_download, repo, revision, filename=filename))


def _call(fn: Any, repo: str, revision: str | None, **kwargs: Any) -> Any:
    hub = _hub()
    errors = hub.errors
    at = f"{repo}" + (f"@{revision}" if revision else "")
    try:
        return fn(repo_id=repo, revision=revision, **kwargs)
    except errors.LocalEntryNotFoundError as exc:
        raise ModelLoadError(
            f"{at} is not in the Hugging Face cache ({hub.constants.HF_HUB_CACHE}) and the Hub cannot be "
            f"reached{' (HF_HUB_OFFLINE is set)' if _offline() else ''}: run once online, or "
            f"`huggingface-cli download {repo}`, then retry") from exc
    except errors.GatedRepoError as exc:
        raise ModelLoadError(f"{at} is gated: accept its terms on huggingface.co and log in "
                             "(HF_TOKEN or `huggingface-cli login`)") from exc
    except errors.RepositoryNotFoundError as exc:
        raise ModelLoadError(f"{repo}: no such model on the Hub (or it is private: set HF_TOKEN)") from exc
    except errors.RevisionNotFoundError as exc:
        raise ModelLoadError(f"{repo}: no revision {revision!r}") from exc
    except errors.EntryNotFoundError as exc:
        raise ModelLoadError(f"{at}: no file {kwargs.get('filename')!r} in the repo") from exc
    except (errors.HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelLoadError(f"{at}: cannot fetch from the Hugging Face Hub: {exc}") from exc
