"""What instances, the router and the vLLM plugin agree on about a request's KV: the transfer
parameters (``kv_params``), their signature (``kv_signing``), prefix-cache block hashes and
KV events (``kv_blocks``). No torch, no sockets."""
