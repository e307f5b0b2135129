"""Who is at the other end of a socket: ``SO_PEERCRED`` on a Unix socket; on loopback
TCP, the owner the kernel's table of the host's sockets names.

The kernel keeps, for every TCP socket of this network namespace, the uid that made
it (identd's source). The worker asks it to know which user a loopback caller is; a
client asks it to know which user listens on the port it reached. An accepted socket
carries its listener's uid, so the server's end of a connection names the user who
bound the port.

It is asked for the one socket by its addresses over ``NETLINK_SOCK_DIAG`` (what
``ss`` uses): a hash lookup. Reading ``/proc/net/tcp`` and ``tcp6`` instead walks
every bucket of the table (about 5 ms of CPU per file here, more with more sockets),
so that is only the fallback: where no such netlink socket can be opened, and for a
socket the kernel says it does not have (a kernel without ``tcp_diag`` says that of
every socket).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
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
    try:
        uid = _diag_owner(want[0], want[1])
    except OSError:  # no sock_diag here (a sandbox that refuses it)
        uid = None
    # "No such socket" is also what a kernel without tcp_diag answers (ENOENT): a miss,
    # rare for a connected peer, is read from the tables before it is believed.
    return uid if uid is not None else _table_owner(want[0], want[1])


# NETLINK_SOCK_DIAG: a request (nlmsghdr, inet_diag_req_v2) naming one socket by its
# addresses, answered by its inet_diag_msg or by an error (ENOENT: no such socket).
_SOCK_DIAG, _BY_FAMILY, _NLMSG_ERROR, _NLM_F_REQUEST = 4, 20, 2, 1
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_REQUEST = struct.Struct("=BBBxI")  # family, protocol, extensions, states
_SOCKID = struct.Struct("!HH16s16s")  # ports, then addresses (network order)
_TAIL = struct.Struct("=III")  # interface, cookie (none: all ones)
_MSG = struct.Struct("=BBBB48sIIIII")  # family .. id, expires, queues, uid, inode
_NO_COOKIE = 0xFFFFFFFF


def _diag_owner(local: tuple[Address, int], remote: tuple[Address, int]) -> int | None:
    """The socket's uid as the kernel answers over sock_diag; None if it has none such.
    An IPv4 pair is asked as IPv4: that finds an IPv6 listener's socket for an IPv4
    caller too (it is hashed by its IPv4 addresses)."""
    if isinstance(local[0], ipaddress.IPv4Address) and isinstance(remote[0], ipaddress.IPv4Address):
        family, src, dst = (
            socket.AF_INET,
            local[0].packed.ljust(16, b"\0"),
            remote[0].packed.ljust(16, b"\0"),
        )
    else:
        family, src, dst = socket.AF_INET6, _as_v6(local[0]).packed, _as_v6(remote[0]).packed
    body = (
        _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF)
        + _SOCKID.pack(local[1], remote[1], src, dst)
        + _TAIL.pack(0, _NO_COOKIE, _NO_COOKIE)
    )
    with socket.socket(
        socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, _SOCK_DIAG
    ) as nl:
        nl.settimeout(1.0)  # the kernel answers at once; a bound all the same
        nl.send(_HEADER.pack(_HEADER.size + len(body), _BY_FAMILY, _NLM_F_REQUEST, 1, 0) + body)
        return _diag_answer(nl.recv(8192))


def _diag_answer(data: bytes) -> int | None:
    """The uid in the kernel's answer; None for "no such socket"."""
    length, kind, _, seq, _ = _HEADER.unpack_from(data)
    if seq != 1 or length > len(data):
        raise OSError(errno.EPROTO, "sock_diag answered another request")
    if kind == _NLMSG_ERROR:
        code = -struct.unpack_from("=i", data, _HEADER.size)[0]
        if code == errno.ENOENT:
            return None
        raise OSError(code, os.strerror(code))
    if kind != _BY_FAMILY or length < _HEADER.size + _MSG.size:
        raise OSError(errno.EPROTO, f"sock_diag answered message type {kind}")
    return int(_MSG.unpack_from(data, _HEADER.size)[8])


def _as_v6(address: Address) -> ipaddress.IPv6Address:
    if isinstance(address, ipaddress.IPv6Address):
        return address
    return ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + address.packed)


def _table_owner(local: tuple[Address, int], remote: tuple[Address, int]) -> int | None:
    """The socket's uid as ``/proc/net/tcp{,6}`` list it; None if it is not listed."""
    want = (local, remote)
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
