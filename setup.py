"""The native pieces of kvwire: three small C extensions.

* the shared-memory plane's run copier (docs/decisions/112-native-run-copies.md);
* the CPU engine's decode attention over the paged KV cache
  (docs/decisions/148-paged-decode-attention-kernel.md);
* the CPU engine's causal attention of whole prompts (docs/decisions/152-prompt-attention-kernel.md).

Everything else is in pyproject.toml. Both are optional: without a C compiler kvwire still installs,
the plane copies runs in Python (slower, holding the GIL; ``kvwire.transfer.planes.shm.send.NATIVE``
is False) and decode attention gathers the blocks and runs torch's SDPA
(``kvwire.engine.attention.NATIVE_DECODE`` is False), prompts run torch's SDPA one at a time
(``NATIVE_PROMPT`` is False); each logs a warning.
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
    ]
)
