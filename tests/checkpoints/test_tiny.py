"""The embedded tiny pipelines show what happened to a request: their images span the pixel range
and every input moves them by more than the tolerance (1/255) the HTTP tests compare PNGs with,
so a request answered with another's image, or without its adapter, fails those tests.

Measured on the unsharded diffusers pipelines (the references of every parity test), at the
settings the tests use: 64x64, 6 steps, guidance 5."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

#: The least mean change, in /255, that an input must make: two seeds, and each other input.
SEED_MIN, INPUT_MIN = 20.0, 3.0
BASE = dict(
    prompt="A cat and a dog baking a cake together in a kitchen.",
    height=64,
    width=64,
    num_inference_steps=6,
    guidance_scale=5.0,
    num_frames=1,
)


def pixels(pipe, seed: int = 7, flow_shift: float | None = None, **fields) -> np.ndarray:
    """The pipeline's frames as 0-255 integers, as a PNG of them would hold."""
    scheduler = pipe.scheduler
    if flow_shift is not None:
        key = "flow_shift" if "flow_shift" in scheduler.config else "shift"
        pipe.scheduler = type(scheduler).from_config(scheduler.config, **{key: flow_shift})
    try:
        out = pipe(**{**BASE, **fields}, generator=torch.Generator().manual_seed(seed), output_type="np")
    finally:
        pipe.scheduler = scheduler
    return np.round(out.frames[0] * 255)


def moved(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).mean())


@pytest.fixture(scope="module")
def lora_pipe(tiny_model):
    """The tiny pipeline with both embedded adapters, loaded by diffusers itself."""
    from diffusers import DiffusionPipeline

    from ray_hsdp.config.embedded import EMBEDDED_LORAS
    from ray_hsdp.loading.components import resolve_lora_path

    pipe = DiffusionPipeline.from_pretrained(tiny_model)
    pipe.set_progress_bar_config(disable=True)
    for name in EMBEDDED_LORAS:
        pipe.load_lora_weights(str(resolve_lora_path(name)), adapter_name=name)
    pipe.disable_lora()
    return pipe


def test_the_text_to_video_image_spans_the_range_and_every_input_moves_it(lora_pipe, ray_cluster):
    """``ray_cluster`` only for its ``RAY_HSDP_HOME``: the adapters are written to the session's cache."""
    from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

    pipe = lora_pipe
    base = pixels(pipe)
    assert base.min() <= 40 and base.max() >= 215 and base.std() >= 20, (base.min(), base.max(), base.std())
    assert moved(base, pixels(pipe, seed=8)) >= SEED_MIN
    changes = {
        "prompt": pixels(pipe, prompt="A red fox runs through the snowy forest at dawn."),
        "guidance 3": pixels(pipe, guidance_scale=3.0),
        "12 steps": pixels(pipe, num_inference_steps=12),
        "4 steps": pixels(pipe, num_inference_steps=4),
        "flow_shift 2": pixels(pipe, flow_shift=2.0),
    }
    for name in ("tiny-style", "tiny-detail"):
        pipe.enable_lora()
        pipe.set_adapters([name], [1.0])
        changes[name] = pixels(pipe)
        pipe.disable_lora()
    # The caches at the tests' settings (tests/test_step_cache.py): First Block Cache at its default
    # threshold reuses nothing on random weights, so the tests force reuse with a threshold no
    # change reaches.
    for name, cache in {
        "first block cache": FirstBlockCacheConfig(threshold=1e9),
        "taylorseer": TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, use_lite_mode=True),
    }.items():
        pipe.transformer.enable_cache(cache)
        try:
            changes[name] = pixels(pipe)
        finally:
            pipe.transformer.disable_cache()
    small = {name: round(moved(base, image), 2) for name, image in changes.items() if moved(base, image) < INPUT_MIN}
    assert not small, f"inputs that move the image by less than {INPUT_MIN}/255 on average: {small}"


def test_the_image_to_video_frames_follow_the_conditioning_image(tiny_i2v_pipe):
    rng = np.random.default_rng(0)
    noise = Image.fromarray((rng.random((64, 64, 3)) * 255).astype(np.uint8))
    y, x = np.mgrid[0:64, 0:64]
    gradient = Image.fromarray(np.stack([x * 4, y * 4, (x + y) * 2], -1).astype(np.uint8))
    first = pixels(tiny_i2v_pipe, image=noise, num_frames=5)
    assert first.min() <= 40 and first.max() >= 215, (first.min(), first.max())
    assert moved(first, pixels(tiny_i2v_pipe, image=gradient, num_frames=5)) >= INPUT_MIN
    assert moved(first, pixels(tiny_i2v_pipe, image=noise, num_frames=5, seed=8)) >= SEED_MIN


def test_every_process_trains_the_same_tokenizer():
    """Two nodes that write the embedded model must give a prompt the same token ids (the trainer
    alone hands single characters out in hash order: digits got other ids in each process)."""
    import subprocess
    import sys

    from ray_hsdp.checkpoints.standins import train_tokenizer

    code = "from ray_hsdp.checkpoints.standins import train_tokenizer as t; print(t().backend_tokenizer.to_str())"
    written = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        for _ in range(2)
    }
    assert written == {train_tokenizer().backend_tokenizer.to_str()}
