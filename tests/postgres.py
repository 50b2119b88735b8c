"""A real PostgreSQL server for the tests, started in a temporary folder with ``initdb`` and
``pg_ctl`` (Debian's ``postgresql`` package), listening on a Unix socket only, and stopped after."""

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


@contextlib.contextmanager
def postgres_server():
    """Yields a SQLAlchemy URL of a fresh server's ``postgres`` database, its files in a new
    temporary folder that is removed after.

    PostgreSQL refuses to run as root: as root, the server runs as the ``postgres`` user (Debian's
    package makes it), which then owns the folder (outside pytest's folders, which only root may enter)."""
    bins = server_binaries()
    folder = Path(tempfile.mkdtemp(prefix="ray_hsdp_postgres_"))
    data, socket = folder / "data", folder / "socket"
    socket.mkdir(parents=True)
    user = None
    if os.geteuid() == 0:
        user = "postgres"
        owner = pwd.getpwnam(user)
        for path in (folder, socket):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    run = dict(check=True, capture_output=True, user=user, timeout=120)
    subprocess.run([bins / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8"], **run)
    options = f"-k {socket} -c listen_addresses='' -c fsync=off"
    subprocess.run([bins / "pg_ctl", "-D", data, "-o", options, "-w", "-t", "60", "-l", folder / "log", "start"], **run)
    try:
        yield f"postgresql+psycopg://postgres@/postgres?host={socket}"
    finally:
        subprocess.run([bins / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"], **{**run, "check": False})
        shutil.rmtree(folder, ignore_errors=True)
