"""One simulated two-node Ray cluster and one tiny pipeline per test session."""

from __future__ import annotations

import inspect
import os
import socket
import time

import numpy as np
import pytest
import torch

from ray_hsdp.request import GenerationRequest

NODE_CPUS = 4


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """Two simulated nodes of NODE_CPUS logical CPUs each (``ray.cluster_utils.Cluster``).

    ``RAY_HSDP_HOME`` and ``RAY_ADDRESS`` are set before the nodes start, so rank processes,
    ``serve run`` subprocesses and notebook kernels all find the same cluster and cache.
    """
    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_HSDP_HOME"] = str(tmp_path_factory.mktemp("ray_hsdp_home"))
    # Each node's Prometheus endpoint on a port of its own (the metrics tests read them).
    ports = [free_port(), free_port()]
    os.environ["RAY_HSDP_TEST_METRICS_PORTS"] = ",".join(map(str, ports))
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": NODE_CPUS, "include_dashboard": False, "metrics_export_port": ports[0]},
    )
    cluster.add_node(num_cpus=NODE_CPUS, metrics_export_port=ports[1])
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


def reference_frames(pipe, request: GenerationRequest) -> np.ndarray:
    """Runs ``request`` through the unsharded pipeline, written out the way a diffusers user would.

    Returns:
        ``(n, frames, height, width, 3)``; an image pipeline's output gets a frame axis of 1.
    """
    if "num_frames" in inspect.signature(pipe.__call__).parameters:
        video = {"num_frames": request.num_frames, "num_videos_per_prompt": request.n}
    else:
        video = {"num_images_per_prompt": request.n}
    out = pipe(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        height=request.height,
        width=request.width,
        num_inference_steps=request.num_inference_steps,
        guidance_scale=request.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        output_type="np",
        **video,
    )
    return out.frames if hasattr(out, "frames") else out.images[:, None]


def wait_until_healthy(base: str, proc, deadline_s: float = 180) -> None:
    """Polls ``base``/health until it answers 200; fails if ``proc`` exits or the deadline passes."""
    import requests

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            if requests.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server at {base} did not come up")
        time.sleep(1)


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
