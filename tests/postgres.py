"""A real PostgreSQL server for the tests, started in a temporary folder with ``initdb`` and
``pg_ctl`` (Debian's ``postgresql`` package), listening on a Unix socket only, and stopped after;
a test may stop and start it again (a database outage)."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path


def server_binaries() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl`` (Debian keeps them out of PATH), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PostgresServer:
    """A fresh server's files in a new temporary folder; ``url`` is its ``postgres`` database.

    PostgreSQL refuses to run as root: as root, the server runs as the ``postgres`` user (Debian's
    package makes it), which then owns the folder (outside pytest's folders, which only root may enter)."""

    def __init__(self):
        self.bins = server_binaries()
        self.folder = Path(tempfile.mkdtemp(prefix="ray_hsdp_postgres_"))
        self.data, socket = self.folder / "data", self.folder / "socket"
        socket.mkdir(parents=True)
        self.user = None
        if os.geteuid() == 0:
            self.user = "postgres"
            owner = pwd.getpwnam(self.user)
            for path in (self.folder, socket):
                os.chown(path, owner.pw_uid, owner.pw_gid)
        self._run([self.bins / "initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8"])
        self.options = f"-k {socket} -c listen_addresses='' -c fsync=off"
        self.url = f"postgresql+psycopg://postgres@/postgres?host={socket}"

    def _run(self, command: list, check: bool = True) -> None:
        subprocess.run(command, check=check, capture_output=True, user=self.user, timeout=120)

    def start(self) -> None:
        ctl = [self.bins / "pg_ctl", "-D", self.data, "-o", self.options, "-w", "-t", "60"]
        self._run([*ctl, "-l", self.folder / "log", "start"])

    def stop(self, check: bool = True) -> None:
        """Stops the server at once (its clients' connections break, as in a crash or a failover)."""
        self._run([self.bins / "pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop"], check=check)

    def remove(self) -> None:
        self.stop(check=False)
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def postgres():
    """Yields a started ``PostgresServer``, removed after."""
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.remove()


@contextlib.contextmanager
def postgres_server():
    """Yields a SQLAlchemy URL of a fresh server's ``postgres`` database."""
    with postgres() as server:
        yield server.url
