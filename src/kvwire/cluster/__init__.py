"""Local clusters: ``kvwire up`` (router + prefill/decode instances as subprocesses) and ``kvwire demo``."""
