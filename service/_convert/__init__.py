"""Frames to rgb24: the standard conversion, its compiled kernel, the staging slots it fills."""
