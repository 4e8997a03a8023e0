"""The one native piece of kvwire: the shared-memory plane's run copier (a C extension).

Everything else is in pyproject.toml. The extension is optional: without a C compiler kvwire still
installs, and the plane copies runs in Python (slower, holding the GIL; it logs a warning, and
``kvwire.transfer.planes.shm.send.NATIVE`` is False). docs/decisions/112-native-run-copies.md.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvwire.transfer.planes.shm._copy_runs",
            ["src/kvwire/transfer/planes/shm/_copy_runs.c"],
            optional=True,
        )
    ]
)
