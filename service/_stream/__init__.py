"""Streaming encode sessions: one output whose frames arrive chunk by chunk, over time."""
