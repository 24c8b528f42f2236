"""The listening socket `shoal serve` hands to uvicorn.

The CLI binds the port itself, before the model loads, so that a port in use is
a one-line error at once rather than after start-up. uvicorn then serves on that
socket, and asyncio turns Nagle's algorithm off (TCP_NODELAY) on each accepted
connection only when the socket says it is TCP: `proto == IPPROTO_TCP`.
`socket.socket(AF_INET, SOCK_STREAM)` leaves proto 0, and accepted sockets
inherit it. With Nagle on, a response written as headers and then body waits
for the client's ACK of the first part, which a kept-open connection delays by
40 ms on Linux: every request after a connection's first, and the chunks of a
stream, arrived up to 40 ms late (benchmarks/NOTES.md, seventh round).
"""

from __future__ import annotations

import socket


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) (port 0: any free one), ready for `uvicorn.Server.run(sockets=[...])`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
