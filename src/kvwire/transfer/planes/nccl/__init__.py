"""NCCL data plane: point-to-point sends between GPUs (``plane.NcclPlane``).

``bindings`` (ctypes NCCL), ``config`` (``NcclPlaneConfig``), ``plane_info`` (handshake structs),
``channel`` / ``send`` / ``recv`` (one communicator set per peer and direction), ``framing`` (how a
transfer is cut into messages), ``memory`` (registered zero-copy buffers), ``graphs`` (captured
sends), ``device_signal`` (armed sends). Importing this package loads nothing: no torch, no NCCL.
"""
