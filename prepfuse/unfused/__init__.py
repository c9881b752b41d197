"""The unfused sequences prepfuse's ops replace, written as a model author would in plain
PyTorch. They are the baselines the benchmarks time (eager and under ``torch.compile``)."""

from prepfuse.unfused.dsv4 import dsv4_prep_unfused
from prepfuse.unfused.gqa import gqa_prep_unfused

__all__ = ["dsv4_prep_unfused", "gqa_prep_unfused"]
