"""Telling the service manager where the supervisor is: systemd's notify protocol (``Type=notify``).

systemd starts the supervisor with ``NOTIFY_SOCKET`` set (a unix datagram socket's path, or an abstract
name written with a leading ``@``) and reads newline-separated ``KEY=VALUE`` datagrams from it (sd_notify(3);
the protocol is documented as stable for reimplementation, so this is the whole of it, without libsystemd):

- ``READY=1`` once every model loaded at start is serving, the same condition as ``/readyz`` and the gRPC
  health service's overall status: ``systemctl start`` returns then, and units ordered after this one start
  against a server that answers.
- ``STATUS=...`` a line ``systemctl status`` shows: loading, or serving which models.
- ``STOPPING=1`` when shutdown begins (SIGTERM): systemd then waits ``TimeoutStopSec`` for the drain.
- ``WATCHDOG=1`` every half of ``WATCHDOG_USEC`` when the unit sets ``WatchdogSec``, from the supervisor's
  main loop, so a hung main loop gets the unit restarted. Only for this process (``WATCHDOG_PID``).

Without ``NOTIFY_SOCKET`` (a container, a terminal, launchd) every call does nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("supervisor.notify")


class ServiceNotifier:
    def __init__(self, address: str | None, watchdog_usec: int = 0, clock=time.monotonic):
        self.address = address
        self.watchdog_interval = watchdog_usec / 2e6 if watchdog_usec > 0 else 0.0
        self.clock = clock
        self.ready_sent = False
        self._last_ping = float("-inf")
        self._status = ""
        self._socket: socket.socket | None = None
        if address:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._target = "\0" + address[1:] if address.startswith("@") else address

    @classmethod
    def from_environment(cls, environ=os.environ) -> ServiceNotifier:
        watchdog = int(environ.get("WATCHDOG_USEC", "0") or 0)
        pid = environ.get("WATCHDOG_PID")
        if pid and pid != str(os.getpid()):
            watchdog = 0  # meant for another process
        return cls(environ.get("NOTIFY_SOCKET") or None, watchdog)

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def send(self, *fields: str) -> None:
        if self._socket is None:
            return
        try:
            self._socket.sendto("\n".join(fields).encode(), self._target)
        except OSError as error:  # the manager went away: nothing to tell, nothing to fail
            log.warning("could not notify the service manager at %s: %s", self.address, error)

    def tick(self, ready: bool, status: str) -> None:
        """Called from the main loop: READY=1 the first time ``ready``, the status line when it changes,
        and a watchdog ping when one is due."""
        if self._socket is None:
            return
        fields = []
        if ready and not self.ready_sent:
            fields.append("READY=1")
            self.ready_sent = True
        if status != self._status:
            fields.append(f"STATUS={status}")
            self._status = status
        now = self.clock()
        if self.watchdog_interval and now - self._last_ping >= self.watchdog_interval:
            fields.append("WATCHDOG=1")
            self._last_ping = now
        if fields:
            self.send(*fields)

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=draining in-flight requests and stopping runners")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
