"""Tensor parallelism of the built-in engine: one process per rank (decision 055).

``group`` joins the ranks (torch.distributed: gloo on the CPU, NCCL on CUDA, plus a gloo group for
the step messages); ``shard`` cuts a loaded model to one rank's heads and MLP columns; ``workers``
starts ranks 1..N-1 and runs their follow-the-leader loop; ``runner`` is rank 0's model runner,
which hands every step to the workers and merges their connector reports.
"""
