"""The reference every parity check compares with: the unsharded diffusers pipeline, given a
request's choices the way a diffusers user sets them (adapters with ``set_adapters``, a step cache
with the model's ``enable_cache``, a scheduler with its shift). Tests and GPU benches share it."""

from __future__ import annotations

import dataclasses
import inspect
import time

import numpy as np
import torch

from ray_hsdp.request import GenerationRequest, StepCache


def plain_call(pipe, request: GenerationRequest) -> dict:
    """The arguments of ``pipe``'s call for ``request``, written the way its model card has a
    diffusers user write them: independent of ``ray_hsdp``'s own mapping, which the parity tests
    hold to it. The pipelines differ:

    - Qwen-Image guides with ``true_cfg_scale`` and a negative prompt (``" "`` when none: its card's);
    - HunyuanVideo-1.5 takes its guidance on its ``guider`` (set by ``reference_frames``), not in the call;
    - FLUX.2 takes no negative prompt, and its ``image`` is a reference;
    - the others take ``guidance_scale`` and ``negative_prompt``, and an image as the first frame.
    """
    params = inspect.signature(pipe.__call__).parameters
    kind = type(pipe).__name__
    kwargs = {
        "prompt": request.prompt,
        "height": request.height,
        "width": request.width,
        "num_inference_steps": request.num_inference_steps,
        "generator": torch.Generator("cpu").manual_seed(request.seed),
        "output_type": "np",
    }
    if "num_frames" in params:
        kwargs.update(num_frames=request.num_frames, num_videos_per_prompt=request.n)
    else:
        kwargs["num_images_per_prompt"] = request.n
    if kind == "QwenImagePipeline":
        guided = request.guidance_scale > 1
        kwargs["true_cfg_scale"] = request.guidance_scale
        kwargs["negative_prompt"] = (
            request.negative_prompt if request.negative_prompt is not None else (" " if guided else None)
        )
    elif kind.startswith("HunyuanVideo15"):
        kwargs["negative_prompt"] = request.negative_prompt
    elif kind == "Flux2Pipeline":
        kwargs["guidance_scale"] = request.guidance_scale
    else:
        kwargs.update(guidance_scale=request.guidance_scale, negative_prompt=request.negative_prompt)
    if request.guidance_scale_2 is not None:
        kwargs["guidance_scale_2"] = request.guidance_scale_2
    if request.image is not None:  # already fitted to the request's size (request.fit_image)
        kwargs["image"] = request.first_frame()
    return kwargs


def reference_frames(pipe, request: GenerationRequest) -> np.ndarray:
    """Runs ``request`` through the unsharded pipeline, written out the way a diffusers user would
    (``plain_call``; a guider's guidance set with ``guider.new``, a scheduler's shift with its config).

    Returns:
        ``(n, frames, height, width, 3)``; an image pipeline's output gets a frame axis of 1.
    """
    scheduler, guider = pipe.scheduler, getattr(pipe, "guider", None)
    boundary = getattr(pipe.config, "boundary_ratio", None)
    if request.sample_solver is not None:
        pipe.scheduler = solver_as_written(scheduler, request.sample_solver, request.flow_shift)
    elif request.flow_shift is not None:  # Wan's UniPC calls it flow_shift, a flow-match Euler shift
        key = "flow_shift" if "flow_shift" in scheduler.config else "shift"
        pipe.scheduler = type(scheduler).from_config(scheduler.config, **{key: request.flow_shift})
    if guider is not None:
        pipe.guider = guider.new(guidance_scale=request.guidance_scale)
    if request.boundary_ratio is not None:
        pipe.register_to_config(boundary_ratio=request.boundary_ratio)
    call = plain_call(pipe, request)
    if request.sigmas is not None:
        if "sigmas" in inspect.signature(pipe.__call__).parameters:  # Qwen-Image, FLUX: a call argument
            call["sigmas"] = list(request.sigmas)
        else:  # Wan's pipelines take none: the scheduler is told them at its set_timesteps
            pipe.scheduler = with_sigmas(pipe.scheduler, list(request.sigmas))
    try:
        out = pipe(**call)
    finally:
        pipe.scheduler = scheduler
        if guider is not None:
            pipe.guider = guider
        if request.boundary_ratio is not None:
            pipe.register_to_config(boundary_ratio=boundary)
    return out.frames if hasattr(out, "frames") else out.images[:, None]


def solver_as_written(scheduler, solver: str, flow_shift: float | None):
    """The scheduler a diffusers user writes for ``solver`` at the model's shift (or ``flow_shift``):
    Wan's model card's UniPC, or diffusers' flow-match Euler."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    config = scheduler.config
    shift = flow_shift if flow_shift is not None else config.get("flow_shift", config.get("shift"))
    if solver == "euler":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=config["num_train_timesteps"], shift=shift)
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        num_train_timesteps=config["num_train_timesteps"],
        flow_shift=shift,
    )


def with_sigmas(scheduler, sigmas: list[float]):
    """A copy of a flow-match Euler ``scheduler`` whose ``set_timesteps`` sets ``sigmas``."""
    copy = type(scheduler).from_config(scheduler.config)
    own = copy.set_timesteps
    copy.set_timesteps = lambda num_inference_steps=None, device=None, **kw: own(sigmas=sigmas, device=device)
    return copy


def timed_frames(pipe, request: GenerationRequest) -> tuple[np.ndarray, float, int]:
    """``request``'s frames from plain diffusers after a 2-step warm-up of the same request: the
    frames, the request's seconds, and its CUDA peak bytes (0 off CUDA)."""
    cuda = torch.cuda.is_available() and pipe.device.type == "cuda"
    reference_frames(pipe, dataclasses.replace(request, num_inference_steps=2))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    frames = reference_frames(pipe, request)
    if cuda:
        torch.cuda.synchronize()
    return frames, time.perf_counter() - start, torch.cuda.max_memory_allocated() if cuda else 0


def pipeline_with_adapters(folder: str, loras: dict[str, str], fused: dict[str, float] | None = None):
    """The unsharded pipeline with adapters loaded by diffusers itself: those of ``fused`` merged
    with ``fuse_lora`` (then unloaded: their layers go, the merged weights stay), the others
    switchable by ``reference_with``."""
    from diffusers import DiffusionPipeline

    from ray_hsdp.loading.components import resolve_lora_path

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
