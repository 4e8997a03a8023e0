"""The native pieces of kvwire: four small C extensions.

* the shared-memory plane's run copier (docs/decisions/112-native-run-copies.md);
* the CPU engine's decode attention over the paged KV cache
  (docs/decisions/148-paged-decode-attention-kernel.md);
* the CPU engine's causal attention of whole prompts (docs/decisions/152-prompt-attention-kernel.md);
* the CPU engine's int8 weight-only matrix product for few rows (docs/decisions/157-quantized-decode-gemm.md).

Everything else is in pyproject.toml. All are optional: without a C compiler kvwire still installs,
the plane copies runs in Python (slower, holding the GIL; ``kvwire.transfer.planes.shm.send.NATIVE``
is False) and decode attention gathers the blocks and runs torch's SDPA
(``kvwire.engine.attention.NATIVE_DECODE`` is False), prompts run torch's SDPA one at a time
(``NATIVE_PROMPT`` is False), int8 layers torch's ``_weight_int8pack_mm``
(``kvwire.engine.quant.NATIVE_QUANT`` is False, also on a CPU without AVX512-BF16); each logs a warning.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvwire.transfer.planes.shm._copy_runs",
            ["src/kvwire/transfer/planes/shm/_copy_runs.c"],
            optional=True,
        ),
        Extension(
            "kvwire.engine._paged_attention",
            ["src/kvwire/engine/_paged_attention.c"],
            optional=True,
        ),
        Extension(
            "kvwire.engine._prompt_attention",
            ["src/kvwire/engine/_prompt_attention.c"],
            optional=True,
        ),
        Extension(
            "kvwire.engine._quant_matmul",
            ["src/kvwire/engine/_quant_matmul.c"],
            optional=True,
        ),
    ]
)
