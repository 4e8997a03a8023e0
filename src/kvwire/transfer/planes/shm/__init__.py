"""Shared-memory data plane for CPU tensors of two processes on one host (see ``plane``)."""
