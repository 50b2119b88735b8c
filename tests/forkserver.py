"""Ray workers forked from one process that has already imported torch, diffusers and transformers.

Why: on the suite's 2-core machines a rank process spends about 8 s of CPU before its group is
ready, most of it importing torch, diffusers and transformers (``bench/results/suite-2core.md``);
a suite run starts about 250 Ray workers, and the ranks were more than half of its CPU. Here the
suite's two simulated nodes start each Python worker as this file (``worker_path``, passed to
``ray.cluster_utils.Cluster``). It hands the worker's command line, environment and standard
streams to the fork server (``serve``), which forks a child that runs Ray's own
``default_worker.py`` as ``__main__``: a real Ray worker (it registers with the raylet under its
own pid, which the raylet then signals), only without paying those imports again. The server
imports no Ray: the gRPC core must not exist before a fork.

The process the raylet started (this file run as a script) stays until the worker exits and
exits with its status; it forwards SIGTERM and SIGINT. If it dies, the worker sees its
connection close and exits at once. The real start path (a fresh interpreter) is what the
two-node test (``ray start`` in network namespaces) and ``tests/serve/test_usp.py`` (a Ray of its own)
run.
"""

from __future__ import annotations

import array
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import sys

#: What the tiny pipelines' ranks import first; each child skips these.
PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "diffusers",
    "transformers",
    "peft",
)
#: The tiny Wan pipeline's classes (most groups of the suite load it).
PRELOAD_ATTRIBUTES = {
    "diffusers": ("WanPipeline", "WanTransformer3DModel", "AutoencoderKLWan", "FlowMatchEulerDiscreteScheduler"),
    "transformers": ("UMT5EncoderModel", "AutoTokenizer"),
}
SOCKET_ENV = "RAY_HSDP_TEST_FORKSERVER"


def _send_message(sock: socket.socket, payload: dict, fds: list[int]) -> None:
    data = json.dumps(payload).encode()
    sock.sendmsg([struct.pack("!I", len(data)), data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def _read_to(sock: socket.socket, data: bytes, size: int) -> bytes:
    """``data`` read on from ``sock`` until it holds ``size`` bytes.

    Raises:
        ConnectionError: The other end closed the connection first.
    """
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the connection closed mid-message")
        data += chunk
    return data


def _receive_message(sock: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    head, ancillary, _, _ = sock.recvmsg(4, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    (size,) = struct.unpack("!I", _read_to(sock, head, 4))
    return json.loads(_read_to(sock, b"", size)), list(fds)


def _threads_from_ray() -> None:
    """Sizes torch's thread pool the way a fresh worker's is.

    A fresh worker imports torch after Ray has set ``OMP_NUM_THREADS`` to its task's CPUs (before
    the first task runs), and torch sizes its pool from it; the server's torch was sized at import.
    So when Ray sets it here, torch is told."""
    import torch
    from ray._private import utils

    set_if_unset = utils.set_omp_num_threads_if_unset

    def set_and_apply() -> bool:
        changed = set_if_unset()
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        return changed

    utils.set_omp_num_threads_if_unset = set_and_apply


def _run_child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: becomes the worker the raylet asked for, then exits."""
    import runpy
    import threading

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = request["argv"]
    sys.path[0] = os.path.dirname(request["argv"][0])
    _threads_from_ray()
    import numpy

    numpy.random.seed()  # a fresh process seeds numpy's global generator from the OS; Python's reseeds itself

    def exit_with_the_client() -> None:  # the raylet's process is gone: so is this worker
        while conn.recv(64):
            pass
        os._exit(1)

    threading.Thread(target=exit_with_the_client, daemon=True, name="forkserver-client").start()
    code = 0
    try:
        runpy.run_path(request["argv"][0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def serve(path: str) -> None:
    """The fork server: imports ``PRELOAD`` once, then forks a worker per client until killed."""
    for name in PRELOAD:
        module = importlib.import_module(name)
        for attribute in PRELOAD_ATTRIBUTES.get(name, ()):
            getattr(module, attribute)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wakeup_read, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive_message(conn)
                except (OSError, ValueError, ConnectionError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wakeup_read)
                    os.close(wakeup_write)
                    for other in children.values():
                        other.close()
                    _run_child(conn, request, fds)
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                try:
                    conn.sendall(struct.pack("!i", pid))
                except OSError:
                    pass
            else:
                os.read(wakeup_read, 4096)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                conn.close()


def client(path: str, argv: list[str]) -> int:
    """What the raylet starts: asks the server for the worker and waits for its end."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    _send_message(sock, request, [0, 1, 2])

    def read_int() -> int | None:
        try:
            return struct.unpack("!i", _read_to(sock, b"", 4))[0]
        except ConnectionError:
            return None

    child = read_int()
    if child is None:
        return 1
    for forwarded in (signal.SIGTERM, signal.SIGINT):
        signal.signal(forwarded, lambda number, _frame: os.kill(child, number))
    code = read_int()
    if code is None:
        return 1
    if code < 0:  # killed by a signal: end the same way
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def default_worker_path() -> str:
    """Ray's ``default_worker.py``, found without importing Ray (the server must not)."""
    from importlib.util import find_spec

    (package,) = find_spec("ray").submodule_search_locations
    return os.path.join(package, "_private", "workers", "default_worker.py")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        sys.exit(client(os.environ[SOCKET_ENV], [default_worker_path(), *sys.argv[1:]]))
