"""framewire.core: what the client and the worker share, below both.

The wire models (``wire``), the errors and their codes (``errors``), the ffmpeg
commands and the child that runs them (``media``), the fd socket's framing
(``fdsocket``), what an array or tensor of frames is (``frames``), named shm
segments (``shm``) and the reference decode (``decode``, ``reference``). It
needs only the client's dependencies. Its modules are the project's own, not a
user's API: a user imports ``framewire.client``, which re-exports what is
theirs.
"""
