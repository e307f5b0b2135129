"""A process's ``/proc/<pid>/stat``, read once per question: its fields after the command
name."""

from __future__ import annotations


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` from the state (field 3) on; None once ``pid``
    cannot be read (gone). The command name (field 2) may hold spaces and parentheses:
    the fields start after its last ")"."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(b")", 1)[-1].split()
