"""What the HTTP front doors (``kvwire serve``, ``kvwire router``) share: API keys (``auth``), the
refused-request log (``refusal_log``) and writes to a client under a deadline (``client_writer``)."""
