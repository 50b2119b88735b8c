"""One simulated two-node Ray cluster and one tiny pipeline per test session."""

from __future__ import annotations

import os
import socket

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
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": NODE_CPUS, "include_dashboard": False})
    cluster.add_node(num_cpus=NODE_CPUS)
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
    """Runs ``request`` through the unsharded pipeline, written out the way a diffusers user would."""
    return pipe(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        height=request.height,
        width=request.width,
        num_frames=request.num_frames,
        num_inference_steps=request.num_inference_steps,
        guidance_scale=request.guidance_scale,
        num_videos_per_prompt=request.n,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        output_type="np",
    ).frames


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
