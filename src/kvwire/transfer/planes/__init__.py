"""Data planes: one subpackage per transport behind :class:`kvwire.transfer.planes.base.DataPlane`.

``tcp/`` (raw sockets, CPU tensors), ``shm/`` (shared memory, one host), ``ipc/`` (CUDA IPC, one
host) and ``nccl/`` (NCCL point to point, GPUs); ``factory.make_plane`` imports the one a config
names, lazily, so importing this package imports no plane (and no CUDA). ``base`` holds the
interface, the negotiation, the plane set and the listener bases; ``common/`` what else planes
share (the link hello, socket helpers, admission, copy runs, the GPU group kernels); a plane
imports only ``base`` and ``common``, never another plane.
"""
