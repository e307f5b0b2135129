"""Who is at the other end of a socket: ``SO_PEERCRED`` on a Unix socket; on loopback
TCP, the owner the kernel's table of the host's sockets names.

``/proc/net/tcp`` and ``tcp6`` list every TCP socket of this network namespace
with the uid that made it (identd's source). The worker reads it to know which
user a loopback caller is; a client reads it to know which user listens on the
port it reached. An accepted socket carries its listener's uid, so the server's
end of a connection names the user who bound the port.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peercred(sock: socket.socket) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the process at the other end of a Unix stream socket, as the
    kernel took them when it connected (None when they cannot be had)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    except OSError:
        return None
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def normal(host: str) -> Address:
    """``host`` as an address, an IPv4-mapped IPv6 one as the IPv4 it maps
    (raises ValueError for what is no address)."""
    return _unmapped(ipaddress.ip_address(host.split("%")[0]))


def _unmapped(address: Address) -> Address:
    """An IPv4-mapped IPv6 address as the IPv4 one it maps; any other as it is."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_loopback(host: str) -> bool:
    try:
        return normal(host).is_loopback
    except ValueError:
        return False


def _proc_address(text: str) -> tuple[Address, int]:
    """An address of /proc/net/tcp{,6}: hex words in host byte order, then the port."""
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    # Each 32-bit word was printed as a number: reverse its bytes back into order.
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return _unmapped(ipaddress.ip_address(packed)), int(port, 16)


def tcp_owner(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The uid owning the loopback TCP socket whose own end is ``local`` and whose
    other end is ``remote``; None when ``local`` is not loopback or no such socket is
    listed."""
    try:
        want = ((normal(local[0]), local[1]), (normal(remote[0]), remote[1]))
    except ValueError:
        return None
    if not want[0][0].is_loopback:
        return None
    for table in TABLES:
        with contextlib.suppress(OSError), open(table) as f:
            next(f, None)  # the header
            for line in f:
                fields = line.split()
                if len(fields) < 8:
                    continue
                try:
                    if (_proc_address(fields[1]), _proc_address(fields[2])) == want:
                        return int(fields[7])
                except ValueError:
                    continue
    return None
