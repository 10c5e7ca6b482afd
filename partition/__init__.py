"""Compute shares for the workers: CPU cores now; SM partitions (MPS, green contexts) on the GPU."""

PARTITIONS = ("cpu", "none")
