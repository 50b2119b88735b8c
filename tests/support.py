"""What the tests share besides fixtures: the reference run, waits with deadlines, comparisons.

(Not in ``conftest.py``: ``tests/serve`` has a conftest of its own, and both are imported under
the name ``conftest``.)"""

from __future__ import annotations

import random
import socket
from pathlib import Path

import numpy as np

from bench.common import wait_until, wait_until_healthy  # noqa: F401 (shared with the benches)
from bench.reference import (  # noqa: F401 (shared with the benches)
    pipeline_with_adapters,
    random_png,
    reference_frames,
    reference_with,
)

NODE_CPUS = 4
#: How often the session's cluster exports metrics (``RAY_metrics_report_interval_ms``).
METRICS_EXPORT_S = 1.0


def embedded_pipeline(name: str, pipeline_class: str | None = None) -> tuple[str, object]:
    """An embedded tiny model's folder (written on first use, as a rank writes it) and its plain,
    unsharded diffusers pipeline (of ``pipeline_class``, or the one its folder names): the reference."""
    from ray_hsdp.loading.components import load_pipeline, resolve_model_path
    from ray_hsdp.loading.components import pipeline_class as class_named

    folder = resolve_model_path(name)
    pipe = load_pipeline(folder, "float32", pipeline_cls=class_named(folder, pipeline_class))
    pipe.set_progress_bar_config(disable=True)
    return str(folder), pipe


def style_lora(folder: str, directory: Path) -> dict[str, str]:
    """A random LoRA (rank 4, every block linear) for the transformer of the pipeline at ``folder``,
    written under ``directory``: a ``loras`` config naming it ``style``."""
    from ray_hsdp.checkpoints.lora import make_random_lora

    make_random_lora(folder, directory / "style", rank=4, seed=1, dtype="float32")
    return {"style": str(directory / "style")}


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


#: Ports ``free_port`` handed out in this process: never twice.
_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for ``bind(0)`` (Linux: ``ip_local_port_range``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free now on every interface, below the kernel's ephemeral range and never handed
    out before in this session.

    Between this call and the bind that uses the port, Ray's processes start and take dozens of
    ports with ``bind(0)``; a port from the ephemeral range (where a ``bind(0)`` probe would find
    one) can be taken by one of them, which failed a run when a node's metrics port was (its
    agent: "Address already in use"). No ``bind(0)`` ever returns a port below the range.
    """
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    for port in random.sample(range(low, high), min(500, high - low)):
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free TCP port between {low} and {high}")


def wan_transformer_inputs(config) -> dict:
    """A forward's inputs for a Wan transformer of ``config`` (the tiny one's shapes: 2 latent frames of
    8x8, 8 text tokens), drawn from torch's global generator: seed it first."""
    import torch

    return dict(
        hidden_states=torch.randn(1, config.in_channels, 2, 8, 8),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, config.text_dim),
    )
