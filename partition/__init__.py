"""Compute shares for the workers: CPU cores, MPS thread percentages on GPUs (backends.py), the share manager
(manager.py), the partition profile (profile.py) and `ppd probe` (probe*.py)."""
