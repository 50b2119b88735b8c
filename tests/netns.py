"""Two real Ray nodes on this one machine: two network namespaces joined by a veth pair.

Only addresses of 198.51.100.0/24 (TEST-NET-2, never routed on the internet) are used: node A
is 198.51.100.1 and node B 198.51.100.2 (a /30 between them); the host namespace reaches A at
198.51.100.6 from 198.51.100.5 (a second /30), and B through A, which forwards. Nothing else
is touched: the host gets one veth end and one route, both gone with the namespaces.

Processes are stopped by pid (``ip netns pids``), never with ``ray stop``, which would kill
every Ray process of the machine (the test session's own cluster too).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

NODE_IPS = ("198.51.100.1", "198.51.100.2")
HOST_IP, ENTRY_IP = "198.51.100.5", "198.51.100.6"
GCS_PORT = 6379
#: Node death is noticed within about a second and a half (Ray's default: half a minute).
FAST_HEALTH_CHECKS = {
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
}


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = (["ip", "netns", "exec", netns] if netns else []) + ["ip", *args]
    return subprocess.run(command, check=check, capture_output=True, text=True, timeout=30)


@dataclass
class TwoNodes:
    """The namespaces, the environment their Ray processes share and where their files go."""

    namespaces: tuple[str, str]
    env: dict[str, str]
    temp_dir: Path
    logs: list[Path] = field(default_factory=list)
    worker_started: Future | None = None

    def joined(self, timeout_s: float = 120) -> None:
        """Waits until node B's ``ray start`` has returned (it raises if that failed)."""
        self.worker_started.result(timeout=timeout_s)

    @property
    def head(self) -> str:
        return f"{NODE_IPS[0]}:{GCS_PORT}"

    def run(self, node: int, *command: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
        """Runs ``command`` in node ``node``'s namespace with the cluster's environment."""
        log = self.temp_dir / f"node{node}-{len(self.logs)}.log"
        self.logs.append(log)
        with open(log, "w") as out:
            proc = subprocess.run(
                ["ip", "netns", "exec", self.namespaces[node], *command],
                env=self.env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s,
            )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed in node {node}: {log.read_text()[-3000:]}")
        return proc

    def pids(self, node: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[node]], capture_output=True, text=True)
        return [int(pid) for pid in out.stdout.split()]

    def kill(self, node: int, process: str) -> list[int]:
        """SIGKILLs node ``node``'s processes whose command line holds ``process``."""
        killed = []
        for pid in self.pids(node):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if process in cmdline:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        return killed

    def tail(self) -> str:
        """The last lines of every command's log and of the Ray logs: what a failure message shows."""
        parts = [f"--- {log.name}\n{log.read_text()[-1500:]}" for log in self.logs if log.exists()]
        for name in ("raylet.out", "gcs_server.out", "serve/controller_*.log", "serve/replica_*HSDPServer*.log"):
            for path in sorted(self.temp_dir.glob(f"*/session_latest/logs/{name}")):
                parts.append(f"--- {path}\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)


def _start_ray(nodes: TwoNodes, cpus: tuple[int, int], pool: ThreadPoolExecutor) -> None:
    """``ray start`` on both nodes at once (the worker's waits for the head's GCS to answer); returns
    once the head runs, the worker's start going on in ``pool`` (``TwoNodes.joined``)."""
    ray = str(Path(sys.executable).with_name("ray"))
    common = ["--disable-usage-stats", "--object-store-memory", str(150 * 2**20), "--num-gpus", "0"]
    head = [
        ray, "start", "--head", "--node-ip-address", NODE_IPS[0], "--port", str(GCS_PORT),
        "--num-cpus", str(cpus[0]), "--temp-dir", str(nodes.temp_dir / "a"), "--include-dashboard", "false", *common,
    ]  # fmt: skip
    worker = [
        ray, "start", "--address", nodes.head, "--node-ip-address", NODE_IPS[1],
        "--num-cpus", str(cpus[1]), "--temp-dir", str(nodes.temp_dir / "b"), *common,
    ]  # fmt: skip
    nodes.worker_started = pool.submit(nodes.run, 1, *worker)
    nodes.run(0, *head)


def _link(tag: str, namespaces: tuple[str, str]) -> None:
    a, b = namespaces
    for ns in namespaces:
        subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
        _ip("link", "set", "lo", "up", netns=ns)
    # Node A <-> node B.
    _ip("link", "add", f"{tag}ab", "type", "veth", "peer", "name", f"{tag}ba")
    _ip("link", "set", f"{tag}ab", "netns", a)
    _ip("link", "set", f"{tag}ba", "netns", b)
    _ip("addr", "add", f"{NODE_IPS[0]}/30", "dev", f"{tag}ab", netns=a)
    _ip("addr", "add", f"{NODE_IPS[1]}/30", "dev", f"{tag}ba", netns=b)
    # The host <-> node A; A forwards to B, B answers the host through A.
    _ip("link", "add", f"{tag}h", "type", "veth", "peer", "name", f"{tag}ha")
    _ip("link", "set", f"{tag}ha", "netns", a)
    _ip("addr", "add", f"{HOST_IP}/30", "dev", f"{tag}h")
    _ip("addr", "add", f"{ENTRY_IP}/30", "dev", f"{tag}ha", netns=a)
    for dev, ns in ((f"{tag}ab", a), (f"{tag}ba", b), (f"{tag}ha", a), (f"{tag}h", None)):
        _ip("link", "set", dev, "up", netns=ns)
    subprocess.run(["ip", "netns", "exec", a, "sysctl", "-qw", "net.ipv4.ip_forward=1"], check=True, timeout=30)
    _ip("route", "add", f"{NODE_IPS[0].rsplit('.', 1)[0]}.0/30", "via", ENTRY_IP)
    _ip("route", "add", f"{HOST_IP}/32", "via", NODE_IPS[0], netns=b)


def _remove(tag: str, nodes: TwoNodes | None, namespaces: tuple[str, str]) -> None:
    """Kills every process of both namespaces, deletes them and the host's veth end; waits until
    the processes are gone."""
    for ns in namespaces:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in out.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 30
    while any(
        subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.strip() for ns in namespaces
    ):
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for ns in namespaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    _ip("link", "del", f"{tag}h", check=False)


@contextmanager
def two_nodes(cpus: tuple[int, int], env: dict[str, str]):
    """Yields a ``TwoNodes`` whose Ray head runs in namespace A while a worker joins from B
    (``TwoNodes.joined`` waits for it: a deploy can start meanwhile).

    ``env`` is every Ray process's environment (give it no ``RAY_ADDRESS``); the namespaces,
    their processes, the host's veth end and the temporary folder are removed on the way out,
    also when the body fails.
    """
    tag = f"rh{os.getpid() % 100000}"
    namespaces = (f"{tag}a", f"{tag}b")
    # A short folder: Ray's socket paths live under it and a Unix socket path has 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="rh2n", dir="/tmp"))
    nodes = None
    pool = ThreadPoolExecutor(1)
    try:
        _link(tag, namespaces)
        nodes = TwoNodes(namespaces, {**env, **FAST_HEALTH_CHECKS}, temp_dir)
        _start_ray(nodes, cpus, pool)
        yield nodes
    finally:
        _remove(tag, nodes, namespaces)
        pool.shutdown(wait=True)  # its ray start ended with the namespace's processes
        shutil.rmtree(temp_dir, ignore_errors=True)
