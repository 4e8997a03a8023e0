"""CUDA IPC data plane: two processes of one host write into each other's GPU memory (see ``plane``)."""
