"""Data planes: one subpackage per transport behind :class:`kvwire.transfer.planes.base.DataPlane`.

``tcp/`` (raw sockets, CPU tensors) and ``nccl/`` (NCCL point to point, GPUs); ``factory.make_plane``
imports the one a config names, lazily, so importing this package imports no plane (and no CUDA).
``cuda_paged`` holds the GPU block-run gather/scatter kernels that GPU planes share.
"""
