"""What the data planes share (decision 130): ``hello`` (the link hello), ``wire`` (socket reads and
writes, timings, peer credentials), ``admission`` (listener caps), ``liveness``, ``link_config``,
``outbound`` (a writer per peer), ``runs`` (copy runs between byte spans), ``stream_memops`` and
``group_kernels`` (GPU). The plane bases (one acceptor and close for tcp, shm and ipc; the same-host
planes' abstract socket) are ``planes/base.py``'s ``ListenerPlane`` and ``UnixLinkPlane``
(decision 139). Nothing here imports a plane; this package imports nothing itself (the vLLM
plugin's config mapping imports ``link_config`` without torch).
"""
