"""The reference every parity check compares with: the unsharded diffusers pipeline, given a
request's choices the way a diffusers user sets them (adapters with ``set_adapters``, a step cache
with the model's ``enable_cache``, a scheduler with its shift). Tests and GPU benches share it."""

from __future__ import annotations

import inspect

import numpy as np
import torch

from ray_hsdp.request import GenerationRequest, StepCache


def reference_frames(pipe, request: GenerationRequest) -> np.ndarray:
    """Runs ``request`` through the unsharded pipeline, written out the way a diffusers user would.

    Returns:
        ``(n, frames, height, width, 3)``; an image pipeline's output gets a frame axis of 1.
    """
    if "num_frames" in inspect.signature(pipe.__call__).parameters:
        video = {"num_frames": request.num_frames, "num_videos_per_prompt": request.n}
    else:
        video = {"num_images_per_prompt": request.n}
    if request.guidance_scale_2 is not None:
        video["guidance_scale_2"] = request.guidance_scale_2
    if request.image is not None:  # already fitted to the request's size (request.fit_image)
        video["image"] = request.first_frame()
    scheduler = pipe.scheduler
    if request.flow_shift is not None:  # Wan's UniPC calls it flow_shift, a flow-match Euler shift
        key = "flow_shift" if "flow_shift" in scheduler.config else "shift"
        pipe.scheduler = type(scheduler).from_config(scheduler.config, **{key: request.flow_shift})
    try:
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
    finally:
        pipe.scheduler = scheduler
    return out.frames if hasattr(out, "frames") else out.images[:, None]


def pipeline_with_adapters(folder: str, loras: dict[str, str], fused: dict[str, float] | None = None):
    """The unsharded pipeline with adapters loaded by diffusers itself: those of ``fused`` merged
    with ``fuse_lora`` (then unloaded: their layers go, the merged weights stay), the others
    switchable by ``reference_with``."""
    from diffusers import DiffusionPipeline

    from ray_hsdp.loading import resolve_lora_path

    fused = fused or {}
    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    for name, scale in fused.items():
        pipe.load_lora_weights(str(resolve_lora_path(loras[name])), adapter_name=name)
        pipe.fuse_lora(lora_scale=scale, adapter_names=[name])
        pipe.unload_lora_weights()
    for name, source in loras.items():
        if name not in fused:
            pipe.load_lora_weights(str(resolve_lora_path(source)), adapter_name=name)
    return pipe


def diffusers_cache_config(cache: StepCache):
    """The same step cache as diffusers' own config."""
    from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

    if cache.kind == "first_block":
        return FirstBlockCacheConfig(threshold=cache.threshold)
    return TaylorSeerCacheConfig(
        cache_interval=cache.interval,
        disable_cache_before_step=cache.warmup_steps,
        disable_cache_after_step=cache.full_after_step,
        taylor_factors_dtype=torch.float32,
        use_lite_mode=True,
    )


def reference_with(pipe, request: GenerationRequest, tiled: bool = False) -> np.ndarray:
    """The unsharded run of ``request`` with its choices set the diffusers way: its adapters
    (``set_adapters``), its step cache as diffusers' own hook on every expert, and the VAE's tiling
    where the sharded run tiles."""
    if request.lora:
        pipe.enable_lora()
        pipe.set_adapters([name for name, _ in request.lora], [scale for _, scale in request.lora])
    elif getattr(pipe, "get_list_adapters", None) and pipe.get_list_adapters():
        pipe.disable_lora()
    experts = [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]
    cache = request.cache
    for expert in experts if cache is not None else ():
        expert.enable_cache(diffusers_cache_config(cache))
    if tiled:
        pipe.vae.enable_tiling()
    try:
        return reference_frames(pipe, request)
    finally:
        for expert in experts if cache is not None else ():
            expert.disable_cache()
        if tiled:
            pipe.vae.disable_tiling()


def random_png(width: int, height: int, seed: int) -> bytes:
    """A PNG of seeded random pixels: a conditioning image every pixel of which matters."""
    import io

    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()
