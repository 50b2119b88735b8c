"""The shipped few-step YAMLs, as users run them, on tiny models of the same families with random
LoRA files in the key layouts of the real ones (lightx2v's original Wan format for Wan2.1 and each
Wan2.2 expert, Qwen-Image-Lightning's ``lora_down`` / ``lora_up`` / ``alpha``): the request a client
sends with no schedule of its own runs the adapter's (steps, sigmas, shift, solver, boundary,
guidance, the scheduler's settings) and equals diffusers with the same files fused by diffusers and
the scheduler written as the model cards write it. Only what a CPU lacks is changed: the device, the
dtype, FP8, compile, the attention kernel and the sizes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from support import max_abs_diff

from bench.reference import random_png, reference_frames
from ray_hsdp.checkpoints.lora import make_random_lora
from ray_hsdp.checkpoints.tiny import make_tiny
from ray_hsdp.config.app import AppConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.serve.schema import ImageGenerationRequest, VideoCreateRequest, to_generation_request, to_video_request

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
#: What the CPU lacks, replaced; every other field is the shipped YAML's.
ON_A_CPU = {
    "device": "cpu", "dtype": "float32", "quantization": "none", "compile": False, "attention_backend": "auto",
    "vae_channels_last": False, "warm_up": [], "default_size": "32x32", "max_pixels": 32 * 32, "max_frames": 9,
}  # fmt: skip
CASES = {
    "wan2.1_t2v_14b_4step.yaml": ({}, "wan"),
    "wan2.2_i2v_a14b_4step.yaml": ({"two_experts": True, "image_to_video": True}, "wan"),
    "qwen_image_lightning.yaml": ({"arch": "qwen-image"}, "lightning"),
}


def served_args(name: str, root: Path) -> tuple[dict, dict]:
    """The YAML's args with a tiny model and random LoRA files of the real layout; and diffusers'
    view of those files: component -> (adapter, path)."""
    tiny, layout = CASES[name]
    args = yaml.safe_load((ROOT / "serve_configs" / name).read_text())["applications"][0]["args"]
    folder = make_tiny(root / "model", **tiny)
    loras, files = {}, {}
    for adapter, parts in args["loras"].items():
        parts = parts if isinstance(parts, dict) else {"transformer": parts}
        for seed, component in enumerate(parts):
            path = make_random_lora(folder, root / f"{adapter}-{component}", rank=4, seed=seed, layout=layout,
                                    dtype="float32", strength=0.2)["path"]  # fmt: skip
            files[component] = (adapter, path)
            loras.setdefault(adapter, {})[component] = path
    return {**args, **ON_A_CPU, "model": str(folder), "loras": loras}, files


def diffusers_pipeline(args: dict, files: dict):
    """The pipeline with the files fused by diffusers and the YAML's scheduler settings written as
    Qwen-Image-Lightning's card writes them (``from_config`` with its values)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(args["model"])
    pipe.set_progress_bar_config(disable=True)
    for component, (adapter, path) in files.items():
        into = {"load_into_transformer_2": True} if component == "transformer_2" else {}
        pipe.load_lora_weights(path, adapter_name=f"{adapter}-{component}", **into)
    for component, (adapter, _) in files.items():
        scale = args["fuse_loras"][adapter]
        pipe.fuse_lora(components=[component], lora_scale=scale, adapter_names=[f"{adapter}-{component}"])
    pipe.unload_lora_weights()
    if args.get("scheduler_config"):
        pipe.scheduler = type(pipe.scheduler).from_config({**pipe.scheduler.config, **args["scheduler_config"]})
    return pipe


def client_request(config: AppConfig, image_to_video: bool, video: bool):
    """What a client sends: a prompt, a size, a seed (and frames, an image): no schedule."""
    if video:
        image = {"input_reference": random_png(32, 32, seed=4)} if image_to_video else {}
        body = VideoCreateRequest(prompt="a fox", size="32x32", num_frames=5, seed=3, **image)
        request, _ = to_video_request(body, config, 4, "few")
    else:
        request = to_generation_request(ImageGenerationRequest(prompt="a fox", size="32x32", seed=3), config, "few")
    return dataclasses.replace(request, uint8_frames=False)  # compared before any encoding


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_shipped_few_step_yaml_runs_its_adapters_schedule_as_diffusers_does(ray_cluster, tmp_path, name):
    args, files = served_args(name, tmp_path)
    config = AppConfig(**args)
    request = client_request(config, "image_to_video" in CASES[name][0], "qwen" not in name)
    defaults = next(iter(args["lora_defaults"].values()))
    # The YAML's schedule, whole, is what the request carries (the reference below runs it as given).
    assert request.num_inference_steps == defaults.get("num_inference_steps", len(defaults.get("sigmas", ())))
    assert request.guidance_scale == defaults["guidance_scale"] == 1.0
    assert request.guidance_scale_2 == defaults.get("guidance_scale_2")
    assert request.sigmas == (tuple(defaults["sigmas"]) if "sigmas" in defaults else None)
    assert (request.flow_shift, request.boundary_ratio) == (defaults.get("flow_shift"), defaults.get("boundary_ratio"))
    assert request.sample_solver in (None, args.get("sample_solver"))
    with ShardGroup(config) as group:
        frames = group.generate([request])[0].frames
    pipe = diffusers_pipeline(args, files)
    assert max_abs_diff(frames, reference_frames(pipe, request)) <= TOL
    # The files and the schedule are what made them: without the files, or with the model's own
    # schedule, diffusers' frames come out otherwise.
    assert max_abs_diff(frames, reference_frames(diffusers_pipeline(args, {}), request)) > 1e-3
    own = dataclasses.replace(request, sigmas=None, sample_solver=None, flow_shift=None, boundary_ratio=None)
    unscheduled = diffusers_pipeline({**args, "scheduler_config": None}, files)
    assert max_abs_diff(frames, reference_frames(unscheduled, own)) > 1e-3
