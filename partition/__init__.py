"""Compute shares for the workers: the partition backends behind one interface, CPU cores, MPS
thread percentages and green-context SM splits on GPUs (backends.py), the MPS daemon at run time
(mps.py), green contexts (green.py), the share manager (manager.py), the partition profile
(profile.py) and `ppd probe` (probe*.py)."""


class PartitionError(ValueError):
    """A partition that cannot be set up; the message says why and what to do."""
