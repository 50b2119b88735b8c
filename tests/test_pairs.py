"""Features meet in pairs (issue 36): every pair of a group-level setting and a request-level choice
runs and equals its reference, or is refused before any rank runs by the one table of refusals
(``ray_hsdp.pairs``).

Cheaply: one group per group-level shape, each with several group-level settings on at once, runs
many requests together, each with its own mix of request-level choices, built from the bodies a
client sends (so adapter defaults apply) and compared at the float level with the unsharded
diffusers pipeline given the same choices. Both shapes serve the tiny two-expert image-to-video
model (Wan2.2-I2V-A14B's architecture), so every request also brings its conditioning image and
can set guidance_scale_2. ``test_every_pair_is_run_or_refused`` then accounts for every cell."""

from __future__ import annotations

import dataclasses
import io
import time

import numpy as np
import pytest
import torch
from PIL import Image
from support import max_abs_diff, reference_frames, wait_until

from ray_hsdp.checkpoints.tiny import make_tiny
from ray_hsdp.config import AppConfig, GroupConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.request import GenerationRequest, RequestCancelledError
from ray_hsdp.serve.schema import VideoCreateRequest, to_video_request

TOLERANCE = 1e-5
#: ``fused`` (the same file as ``detail``) is merged at load where a shape fuses it, else unused.
LORAS = {"style": "tiny-style", "detail": "tiny-detail", "fused": "tiny-detail"}
#: What a request naming an adapter gets for the fields it leaves out (a distilled adapter's); the
#: fused adapter's apply to every request of its group.
LORA_DEFAULTS = {"detail": {"num_inference_steps": 3, "flow_shift": 3.0}, "fused": {"flow_shift": 2.5}}

GROUP_SETTINGS = (
    "batch",
    "ulysses lane",
    "ring lane",
    "cfg lane",
    "keep_gathered",
    "vae_parallel",
    "compile",
    "fp8",
    "several groups (autoscaling, takeover)",
    "cache kind",
    "fused adapters",
    "image-to-video model",
)
REQUEST_CHOICES = (
    "adapter",
    "several adapters",
    "adapter defaults",
    "cache on",
    "cache settings",
    "cache off",
    "flow_shift",
    "guidance_scale_2",
    "conditioning image",
    "timeout",
    "DELETE",
)


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@dataclasses.dataclass(frozen=True)
class Mix:
    """One request: the body a client sends and the request-level choices it makes."""

    name: str
    body: dict
    choices: tuple[str, ...]


BASE = {"num_frames": 5, "size": "64x64"}  # 4 steps: the app's default_steps
#: The mixes every shape runs at once. Every request brings an image (the model needs one).
MIXES = (
    Mix("plain", {"prompt": "a cat on a roof", "seed": 1}, ("conditioning image", "cache off")),
    Mix("adapter", {"prompt": "a cat on a roof", "seed": 1, "lora": "style"}, ("adapter",)),
    Mix(
        "two adapters",
        {"prompt": "rain", "seed": 2, "lora": "style:0.5,detail", "num_inference_steps": 4},
        ("several adapters",),
    ),
    Mix("defaults", {"prompt": "a harbour", "seed": 3, "lora": "detail"}, ("adapter defaults",)),
    Mix("cache", {"prompt": "a cat on a roof", "seed": 1, "cache": "on"}, ("cache on",)),
    Mix("flow_shift", {"prompt": "waves", "seed": 4, "flow_shift": 2.0}, ("flow_shift",)),
    Mix("guidance_scale_2", {"prompt": "waves", "seed": 4, "guidance_scale_2": 2.0}, ("guidance_scale_2",)),
    Mix(
        "all",
        {"prompt": "a fox", "seed": 5, "lora": "style:0.7", "flow_shift": 3.0, "guidance_scale_2": 1.5},
        ("adapter", "flow_shift", "guidance_scale_2", "cache settings"),
    ),
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One group-level shape: the group's config and the settings it stands for."""

    name: str
    fields: dict
    settings: tuple[str, ...]
    #: The cache settings the "all" mix sends (the group's kind).
    cache_settings: dict
    #: Requests at this size also run (vae_parallel: frames of several VAE tiles).
    large: str | None = None


SHAPES = (
    Shape(
        "batch",
        {
            "shard_size": 2,
            "requests_per_rank": 2,
            "keep_gathered": 0.5,
            "cache": {"kind": "taylorseer", "every_request": False},
        },
        ("batch", "keep_gathered", "cache kind", "image-to-video model"),
        {"interval": 3, "warmup_steps": 2},
    ),
    Shape(
        "cfg-ulysses",
        {
            "shard_size": 4,
            "ulysses_degree": 2,
            "cfg_parallel": True,
            "requests_per_rank": 2,
            "vae_parallel": "on",
            "fuse_loras": {"fused": 0.5},
            "cache": {"kind": "first_block", "every_request": False},
        },
        ("ulysses lane", "cfg lane", "vae_parallel", "fused adapters", "cache kind", "image-to-video model"),
        {"threshold": 1e9},  # no change reaches it: every step after the first reuses the cache
        large="320x288",
    ),
)


def reference_pipe(folder: str, fused: dict[str, float]):
    """The unsharded pipeline with the adapters loaded by diffusers itself: the fused ones merged with
    ``fuse_lora`` (then unloaded: their layers go, the merged weights stay), the others switchable."""
    from diffusers import DiffusionPipeline

    from ray_hsdp.loading import resolve_lora_path

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    for name, scale in fused.items():
        pipe.load_lora_weights(str(resolve_lora_path(LORAS[name])), adapter_name=name)
        pipe.fuse_lora(lora_scale=scale, adapter_names=[name])
        pipe.unload_lora_weights()
    for name, source in LORAS.items():
        if name not in fused:
            pipe.load_lora_weights(str(resolve_lora_path(source)), adapter_name=name)
    return pipe


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The tiny two-expert image-to-video pipeline folder."""
    return str(make_tiny(tmp_path_factory.mktemp("models") / "wan22-i2v", two_experts=True, image_to_video=True))


def app_config(folder: str, shape: Shape) -> AppConfig:
    return AppConfig(
        model=folder, device="cpu", loras=LORAS, lora_defaults=LORA_DEFAULTS, default_steps=4, **shape.fields
    )


def mixes_for(shape: Shape) -> list[Mix]:
    """The shape's mixes: the common ones with its cache settings, plus the large ones."""
    out = []
    for mix in MIXES:
        body = dict(mix.body)
        if mix.name == "all":
            body["cache"] = shape.cache_settings
        out.append(Mix(mix.name, body, mix.choices))
    if shape.large:
        out += [
            Mix(
                f"{m.name} {shape.large}",
                {**m.body, "size": shape.large, "num_frames": 1, "num_inference_steps": 2},
                m.choices,
            )
            for m in out
            if m.name in ("adapter", "cache")
        ]
    return out


def build(config: AppConfig, mix: Mix, index: int, **fields) -> GenerationRequest:
    body = VideoCreateRequest(**{**BASE, **mix.body, **fields})
    body = body.model_copy(update={"input_reference": png(64, 48, index)})
    request, _ = to_video_request(body, config, 4, f"{mix.name}#{index}")
    return dataclasses.replace(request, uint8_frames=False)  # compared at the float level


def reference(pipe, config: AppConfig, request: GenerationRequest) -> np.ndarray:
    """The unsharded run of ``request``: its adapters set the diffusers way, its cache as diffusers'
    own hook on both experts, tiling where the lane tiles."""
    from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

    adapters = request.lora
    if adapters:
        pipe.enable_lora()
        pipe.set_adapters([name for name, _ in adapters], [scale for _, scale in adapters])
    else:
        pipe.disable_lora()
    experts = [pipe.transformer, pipe.transformer_2]
    cache = request.cache
    if cache is not None:
        for expert in experts:
            expert.enable_cache(
                FirstBlockCacheConfig(threshold=cache.threshold)
                if cache.kind == "first_block"
                else TaylorSeerCacheConfig(
                    cache_interval=cache.interval,
                    disable_cache_before_step=cache.warmup_steps,
                    disable_cache_after_step=cache.full_after_step,
                    taylor_factors_dtype=torch.float32,
                    use_lite_mode=True,
                )
            )
    tiled = request.width * request.height > 256 * 256
    if tiled:
        pipe.vae.enable_tiling()
    try:
        return reference_frames(pipe, request)
    finally:
        if cache is not None:
            for expert in experts:
                expert.disable_cache()
        if tiled:
            pipe.vae.disable_tiling()


def cut_and_cancelled(group: ShardGroup, config: AppConfig) -> list[tuple[Mix, GenerationRequest]]:
    """A request cut off by its deadline and one cancelled (a DELETE's path) while running, each with
    an adapter and a cache; then a request under each one's id, which must start clean."""
    mix = Mix("long", {"prompt": "a long one", "seed": 9, "lora": "style", "cache": "on"}, ())
    # (timeout_s is an image request's field; a video job has the group's request_timeout_s.)
    cut = dataclasses.replace(build(config, mix, 90, num_inference_steps=200), timeout_s=1.0)
    with pytest.raises(TimeoutError, match="missed its deadline"):
        group.submit(cut).result(timeout=60)
    cancelled = build(config, mix, 91, num_inference_steps=200)
    future = group.submit(cancelled)
    wait_until(lambda: group.progress().get(cancelled.request_id, {}).get("step", 0) >= 1, 60, "the request runs")
    assert group.cancel(cancelled.request_id)
    with pytest.raises(RequestCancelledError):
        future.result(timeout=60)
    after = []
    for choice, gone in (("timeout", cut), ("DELETE", cancelled)):
        follow = Mix(f"after {choice}", mix.body, (choice, "adapter", "cache on"))
        after.append((follow, dataclasses.replace(build(config, follow, 92), request_id=gone.request_id)))
    return after


@pytest.fixture(scope="module")
def runs(ray_cluster, model):
    """Each shape's group runs its mixes at once; returns shape -> [(mix, request, frames)]."""
    folder = model
    out = {}
    for shape in SHAPES:
        config = app_config(folder, shape)
        mixes = mixes_for(shape)
        requests = [build(config, mix, i) for i, mix in enumerate(mixes)]
        started = time.monotonic()
        with ShardGroup(config) as group:
            results = group.generate(requests)
            after = cut_and_cancelled(group, config)
            after_results = group.generate([request for _, request in after])
        print(f"{shape.name}: {len(requests) + len(after) + 2} requests in {time.monotonic() - started:.1f}s")
        out[shape.name] = [
            (mix, request, result.frames)
            for (mix, request), result in zip([*zip(mixes, requests), *after], [*results, *after_results])
        ]
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_each_mix_equals_the_unsharded_pipeline_with_the_same_choices(shape, runs, model):
    config = app_config(model, shape)
    pipe = reference_pipe(model, config.fuse_loras)
    far = {}
    for mix, request, frames in runs[shape.name]:
        diff = max_abs_diff(frames, reference(pipe, config, request))
        if diff > TOLERANCE:
            far[mix.name] = diff
    assert not far, far
    # The adapter defaults reached the request (else "defaults" would equal a plain run).
    defaults = [request for mix, request, _ in runs[shape.name] if mix.name == "defaults"]
    for request in defaults:
        assert (request.num_inference_steps, request.flow_shift) == (3, 3.0)


#: Pairs other tests run, and pairs a GPU run showed (results committed): cell -> where.
ELSEWHERE: dict[tuple[str, str], str] = {}
#: Pairs the table refuses: cell -> a config holding the pair, and the start of its message.
REFUSED: dict[tuple[str, str], tuple[dict, str]] = {
    ("compile", "adapter"): (
        {"loras": LORAS, "compile": True},
        "switched loras (loras not in fuse_loras) with compile",
    ),
    ("fp8", "adapter"): (
        {"loras": LORAS, "quantization": "fp8", "device": "cuda"},
        "switched loras (loras not in fuse_loras) with quantization 'fp8'",
    ),
}
REFUSED[("compile", "several adapters")] = REFUSED[("compile", "adapter")]
REFUSED[("fp8", "several adapters")] = REFUSED[("fp8", "adapter")]


def test_every_pair_is_run_or_refused(runs):
    """Every cell of group-level settings x request-level choices ran above and equalled its
    reference, runs in another test or ran on a GPU (``ELSEWHERE``), or is refused by the table
    with a message that names both."""
    ran = {
        (setting, choice)
        for shape in SHAPES
        for setting in shape.settings
        for mix, _, _ in runs[shape.name]
        for choice in mix.choices
    }
    for fields, message in REFUSED.values():
        with pytest.raises(ValueError) as refused:
            GroupConfig(**fields)
        assert message in str(refused.value), (message, str(refused.value))
    cells = {(s, c) for s in GROUP_SETTINGS for c in REQUEST_CHOICES}
    missing = sorted(cells - ran - set(ELSEWHERE) - set(REFUSED))
    assert not missing, f"{len(missing)} pairs neither run nor refused: {missing}"
