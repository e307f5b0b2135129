"""Outputs in object storage: the spool they are encoded into, the upload, its faults."""
