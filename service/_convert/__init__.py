"""Frames to rgb24: the reference conversion, its compiled kernel, the staging slots it fills."""
