"""The owner of a loopback TCP socket, as the kernel names it: asked for over sock_diag,
read from /proc/net/tcp{,6} where that cannot be opened; both give the same uid."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from framewire.core import sockowners
from framewire.core.sockowners import normal, tcp_owner

from tests.support.identity import NOBODY, as_nobody

# (listener family, listener address, caller's address): an IPv4 pair, an IPv6 one, and
# an IPv4 caller of a dual-stack listener (its end is an IPv4-mapped IPv6 address).
PAIRS = {
    "ipv4": (socket.AF_INET, "127.0.0.1", "127.0.0.1"),
    "ipv6": (socket.AF_INET6, "::1", "::1"),
    "mapped": (socket.AF_INET6, "::", "127.0.0.1"),
}


def _ends(sock: socket.socket) -> tuple[tuple[str, int], tuple[str, int]]:
    return sock.getsockname()[:2], sock.getpeername()[:2]


def _both(local: tuple[str, int], remote: tuple[str, int]) -> tuple[int | None, int | None]:
    """The owner as tcp_owner answers (sock_diag) and as the tables list it."""
    want = ((normal(local[0]), local[1]), (normal(remote[0]), remote[1]))
    return tcp_owner(local, remote), sockowners._table_owner(*want)


def _caller(port: int, address: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
    sock.connect((address, port))
    return sock


def _callers_view(port: int, address: str) -> list[tuple[int | None, int | None]]:
    """In a caller of another user: its own end's owner, then the accepted end's."""
    with _caller(port, address) as caller:
        mine, theirs = _ends(caller)
        return [_both(mine, theirs), _both(theirs, mine)]


@pytest.fixture(params=sorted(PAIRS))
def listener(request) -> Iterator[tuple[socket.socket, str]]:
    family, bound, caller = PAIRS[request.param]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(bound == "::1"))
        sock.bind((bound, 0))
        sock.listen(4)
        yield sock, caller


def test_each_end_is_owned_by_the_user_who_made_it(listener):
    """A caller of another user (65534) owns its end; the accepted end is the listener's
    (root's) even before it is accepted; sock_diag and the tables agree on both."""
    sock, caller = listener
    got = as_nobody(_callers_view, sock.getsockname()[1], caller)
    assert got == [(NOBODY, NOBODY), (0, 0)], got


def test_the_kernel_is_asked_for_the_one_socket_not_the_tables(listener, monkeypatch):
    sock, caller = listener
    read: list[object] = []

    def tables(*want: object) -> None:
        read.append(want)

    with _caller(sock.getsockname()[1], caller) as peer:
        monkeypatch.setattr(sockowners, "_table_owner", tables)
        assert tcp_owner(*_ends(peer)) == 0 and read == []
        # A socket the kernel says it has not is looked for in the tables before it is
        # believed (a kernel without tcp_diag says that of every socket).
        mine, theirs = _ends(peer)
        assert tcp_owner(mine, (theirs[0], theirs[1] ^ 1)) is None and len(read) == 1


def test_where_sock_diag_is_refused_the_tables_answer(listener, monkeypatch):
    """A sandbox that refuses the netlink socket (EPERM, as seccomp would) still gets
    an answer, from /proc/net/tcp{,6}."""
    sock, caller = listener
    made = socket.socket

    def refusing(family: int = -1, *args: object, **kw: object) -> socket.socket:
        if family == socket.AF_NETLINK:
            raise PermissionError(1, "Operation not permitted")
        return made(family, *args, **kw)  # type: ignore[arg-type]

    with _caller(sock.getsockname()[1], caller) as peer:
        monkeypatch.setattr(sockowners.socket, "socket", refusing)
        mine, theirs = _ends(peer)
        assert tcp_owner(mine, theirs) == 0
        assert tcp_owner(mine, (theirs[0], theirs[1] ^ 1)) is None


def test_not_loopback_or_not_an_address_has_no_owner():
    assert tcp_owner(("10.1.2.3", 80), ("127.0.0.1", 5000)) is None
    assert tcp_owner(("localhost", 80), ("127.0.0.1", 5000)) is None
    assert tcp_owner(("127.0.0.1", 1), ("127.0.0.1", 2)) is None
