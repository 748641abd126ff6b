"""Free TCP ports for the servers kvflow starts on this machine, outside the ephemeral range.

A port handed out by binding port 0 comes from the kernel's ephemeral range, the range every
outgoing connection takes its local port from. Between the pick and the server's own bind,
an HTTP or gRPC client of any process can take it, and the server fails to start with
"address already in use". A port below that range is given to no outgoing connection, so
only another explicit bind can take it in between.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""Where Linux keeps the range of ports it gives outgoing connections."""
DEFAULT_EPHEMERAL_LOW = 32768
"""The range's first port where the file cannot be read (Linux's default)."""
LOWEST = 20000
"""Below this, ports are left to services people run on their own (databases, UIs)."""
_TRIES = 50


def _ephemeral_low() -> int:
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW
    return low


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on `host:port` now: nothing else listens there.

    The probe binds with `SO_REUSEADDR`, as Temporal's Go listeners and most servers do, so a
    port held only by closed connections (TIME_WAIT for a minute after a server stops while
    clients were connected) counts as free, while a live listener still makes it taken.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if os.name == "posix":
            # Not on Windows, where SO_REUSEADDR would let the probe bind over a live listener.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free right now, below the ephemeral range where it can.

    Falls back to a port the kernel picks (in that range) where the range starts too low
    to leave room, or where no port tried below it was free.
    """
    low = _ephemeral_low()
    if low - 1 > LOWEST:
        for _ in range(_TRIES):
            port = random.randint(LOWEST, low - 1)
            if port_is_free(port, host):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        picked: int = sock.getsockname()[1]
        return picked
