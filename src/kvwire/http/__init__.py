"""What the HTTP front doors (``kvwire serve``, ``kvwire router``) share: API keys and writes to a
client under a deadline (``front_door``), and the refused-request log (``refusal_log``)."""
