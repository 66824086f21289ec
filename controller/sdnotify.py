"""systemd's notification protocol (sd_notify) in a few lines, without a dependency.

A service with `Type=notify` tells systemd it is ready (`READY=1`), alive (`WATCHDOG=1`,
at least every `WatchdogSec`), and stopping (`STOPPING=1`) by sending datagrams to the unix
socket named in `$NOTIFY_SOCKET` (a leading `@` names an abstract socket).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class Notifier:
    """Sends sd_notify messages; does nothing when not started by systemd."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.socket_path = env.get("NOTIFY_SOCKET", "")
        self.watchdog_s = watchdog_interval_s(env)

    @property
    def enabled(self) -> bool:
        """True when systemd (or a test) listens on `$NOTIFY_SOCKET`."""
        return bool(self.socket_path)

    def notify(self, *lines: str) -> bool:
        """Send `lines` (e.g. "READY=1", "STATUS=...") as one message; False if not sent."""
        if not self.socket_path:
            return False
        address = self.socket_path
        if address.startswith("@"):
            address = "\0" + address[1:]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                # Never block the caller (the daemon's main loop) on a listener that stopped
                # reading: a full queue drops the message instead.
                sock.setblocking(False)
                sock.connect(address)
                sock.sendall("\n".join(lines).encode())
        except OSError:
            return False
        return True


def watchdog_interval_s(environ: Mapping[str, str]) -> float | None:
    """The watchdog period systemd asked for (`WatchdogSec`), or None when it did not.

    `WATCHDOG_PID`, when set, must be this process: the watchdog is meant for it alone.
    """
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 1_000_000
