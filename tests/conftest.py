"""One simulated two-node Ray cluster and one tiny pipeline per test session."""

from __future__ import annotations

import os
import subprocess
import sys

import forkserver
import pytest
from support import METRICS_EXPORT_S, NODE_CPUS, free_port


@pytest.fixture(scope="session")
def worker_forkserver(tmp_path_factory):
    """The fork server the session's Ray workers start from (``tests/forkserver.py`` says why).

    Yields the ``worker_path`` to give each node."""
    path = str(tmp_path_factory.mktemp("forkserver") / "socket")
    server = subprocess.Popen([sys.executable, forkserver.__file__, "--serve", path], stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the fork server did not start (exit status {server.wait()})")
        os.environ[forkserver.SOCKET_ENV] = path
        yield forkserver.__file__
    finally:
        server.kill()
        server.wait()
        os.environ.pop(forkserver.SOCKET_ENV, None)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory, worker_forkserver):
    """Two simulated nodes of NODE_CPUS logical CPUs each (``ray.cluster_utils.Cluster``), whose
    Python workers start from the fork server.

    ``RAY_HSDP_HOME`` and ``RAY_ADDRESS`` are set before the nodes start, so rank processes,
    ``serve run`` subprocesses and notebook kernels all find the same cluster and cache.
    """
    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_HSDP_HOME"] = str(tmp_path_factory.mktemp("ray_hsdp_home"))
    # Metrics reach the nodes' Prometheus endpoints every second (Ray's default: 10 s), so the
    # tests that count them wait seconds, not tens of seconds.
    os.environ["RAY_metrics_report_interval_ms"] = str(int(METRICS_EXPORT_S * 1000))
    # Each node's Prometheus endpoint on a port of its own (the metrics tests read them).
    ports = [free_port(), free_port()]
    os.environ["RAY_HSDP_TEST_METRICS_PORTS"] = ",".join(map(str, ports))
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": NODE_CPUS,
            "include_dashboard": False,
            "metrics_export_port": ports[0],
            "worker_path": worker_forkserver,
        },
    )
    cluster.add_node(num_cpus=NODE_CPUS, metrics_export_port=ports[1], worker_path=worker_forkserver)
    cluster.wait_for_nodes()
    os.environ["RAY_ADDRESS"] = cluster.address
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    os.environ.pop("RAY_ADDRESS", None)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny Wan pipeline folder written by the same code as ``ray-hsdp make-tiny``."""
    from ray_hsdp.checkpoints.tiny import make_tiny

    return str(make_tiny(tmp_path_factory.mktemp("models") / "tiny-wan"))


@pytest.fixture(scope="session")
def reference_pipe(tiny_model):
    """The plain, unsharded diffusers pipeline: the reference every sharded result must equal."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(tiny_model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def tiny_i2v_model(tmp_path_factory) -> str:
    """The tiny image-to-video Wan2.1 pipeline folder (``make-tiny --image-to-video``)."""
    from ray_hsdp.checkpoints.tiny import make_tiny

    return str(make_tiny(tmp_path_factory.mktemp("models") / "tiny-wan-i2v", image_to_video=True))


@pytest.fixture(scope="session")
def tiny_i2v_pipe(tiny_i2v_model):
    """The unsharded image-to-video pipeline: the reference of image-to-video requests."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(tiny_i2v_model)
    pipe.set_progress_bar_config(disable=True)
    return pipe
