"""TCP data plane: raw sockets for CPU tensors (``plane.TcpPlane``; frames in ``wire``)."""
