"""One request on one GPU: plain diffusers against a shard group of one rank, in the same run.

    python -m bench.model_run --arch qwen-image --model-dir /tmp/qwen --size 1328x1328 --steps 8 --guidance 4

Writes the architecture at its real size with random bf16 weights (``make-random``, real-size text
encoders and VAE) unless the folder exists. Then plain diffusers (``from_pretrained(...).to("cuda")``,
the call its model card writes: ``bench.reference``) runs one warm-up request of two steps and the
request; its pipeline is freed, and a group of one rank (``shard_size: 1``) runs the same two. Each
side's seconds, peak GPU memory and the difference of their frames (the same seed) are written.

With ``--lora-rank R`` both sides also load a random LoRA of rank R (every block linear): plain
diffusers by its own loader, the group as a switched adapter (``loras``). Each times the request
without it, then with it; the frames compared are those with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from pathlib import Path

from bench.common import ensure_model, environment, gib, random_loras, start_ray, write_results


def plain_run(model_dir: Path, request, pipeline_class: str | None, device: str, loras: dict[str, str]) -> dict:
    import torch

    from bench.reference import timed_frames
    from ray_hsdp.loading.components import load_pipeline
    from ray_hsdp.loading.components import pipeline_class as class_named

    cuda = device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    start = time.perf_counter()
    pipe = load_pipeline(model_dir, dtype, pipeline_cls=class_named(model_dir, pipeline_class)).to(device)
    load_s = time.perf_counter() - start
    pipe.set_progress_bar_config(disable=True)
    weights = torch.cuda.memory_allocated() if cuda else 0
    without_s = None
    if loras:  # the request without the adapter first, then with it (active at its request's scale)
        _, without_s, _ = timed_frames(pipe, dataclasses.replace(request, lora=()))
        for name, path in loras.items():
            pipe.load_lora_weights(path, adapter_name=name)
        pipe.set_adapters([name for name, _ in request.lora], [scale for _, scale in request.lora])
    frames, request_s, peak = timed_frames(pipe, request)
    out = {
        "load_s": round(load_s, 1),
        "request_s": round(request_s, 2),
        "request_s_without_lora": None if without_s is None else round(without_s, 2),
        "weights_bytes": weights,
        "peak_bytes": peak,
        "frames": frames,
    }
    del pipe
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def group_run(
    model_dir: Path, request, pipeline_class: str | None, device: str, vae_tiling: str, loras: dict[str, str]
) -> dict:
    from ray_hsdp.config.group import GroupConfig
    from ray_hsdp.group import ShardGroup

    config = GroupConfig(
        model=str(model_dir),
        device=device,
        shard_size=1,
        pipeline_class=pipeline_class,
        vae_tiling=vae_tiling,
        loras=loras,
        # One request at a time here; switched adapters on one unsharded rank need it (the table).
        **({"requests_per_rank": 1} if loras else {}),
    )
    start = time.perf_counter()
    without_s = None
    with ShardGroup(config) as group:
        load_s = time.perf_counter() - start
        group.generate([dataclasses.replace(request, num_inference_steps=2)])  # warm-up
        if loras:
            start = time.perf_counter()
            group.generate([dataclasses.replace(request, lora=())])
            without_s = time.perf_counter() - start
        start = time.perf_counter()
        (result,) = group.generate([request])
        request_s = time.perf_counter() - start
        memory = group.memory()[0]
    return {
        "load_s": round(load_s, 1),
        "request_s": round(request_s, 2),
        "request_s_without_lora": None if without_s is None else round(without_s, 2),
        "rank_s": round(result.elapsed_s, 2),
        "weights_bytes": memory["total"]["sharded_local"] + memory["total"]["replicated"],
        "peak_bytes": result.peak_device_bytes,
        "frames": result.frames,
    }


def markdown(payload: dict) -> str:
    plain, ours = payload["plain"], payload["group"]
    lines = [
        f"# {payload['arch']}: one request on one GPU, plain diffusers vs a group of one rank",
        "",
        f"GPU: {', '.join(payload['environment']['gpus']) or 'none'}; request: {payload['request']}",
        f"Command: `{payload['command']}`",
        "",
        "| | load s | request s | weights GiB | peak GiB |",
        "| --- | --- | --- | --- | --- |",
        f"| plain diffusers | {plain['load_s']} | {plain['request_s']} | {gib(plain['weights_bytes'])} | "
        f"{gib(plain['peak_bytes'])} |",
        f"| ray_hsdp, shard_size 1 | {ours['load_s']} | {ours['request_s']} | {gib(ours['weights_bytes'])} | "
        f"{gib(ours['peak_bytes'])} |",
        "",
        f"Frames: max abs difference {payload['max_abs_diff']:.3g}, mean {payload['mean_abs_diff']:.3g} (0-1 scale).",
    ]
    if plain.get("request_s_without_lora") is not None:
        lines += [
            "",
            f"Without the LoRA, in the same run: plain diffusers {plain['request_s_without_lora']} s, "
            f"ray_hsdp {ours['request_s_without_lora']} s.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    import numpy as np

    from ray_hsdp.request import GenerationRequest, fit_image

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--size", default="1024x1024")
    parser.add_argument("--frames", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--pipeline-class", default=None)
    parser.add_argument("--image", action="store_true", help="a synthetic first frame or reference image")
    parser.add_argument("--small-encoders", action="store_true", help="small stand-ins for the text encoders and VAE")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run on the tiny variant")
    parser.add_argument(
        "--vae-tiling", default="off", help="the group's vae_tiling ('off': the whole decode, as plain diffusers)"
    )
    parser.add_argument("--lora-rank", type=int, default=0, help="a random LoRA of this rank on both sides (0: none)")
    parser.add_argument("--ray-cpus", type=int, default=None, help="a Ray of its own with this many CPUs (CPU runs)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    width, height = map(int, args.size.split("x"))
    write_s = ensure_model(args.arch, args.model_dir, args.device, small_encoders=args.small_encoders)
    image = None
    if args.image:
        from bench.reference import random_png

        image = fit_image(random_png(width, height, 0), width, height)
    request = GenerationRequest(
        prompt="A red fox runs through the snowy forest at dawn",
        width=width,
        height=height,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        seed=7,
        image=image,
    )
    loras = {}
    if args.lora_rank:
        lora_dir = args.model_dir.with_name(args.model_dir.name + "-loras")
        loras = random_loras(args.arch, lora_dir, 1, args.lora_rank, args.device)
        request = dataclasses.replace(request, lora=((next(iter(loras)), 1.0),))
    plain = plain_run(args.model_dir, request, args.pipeline_class, args.device, loras)
    start_ray(args.ray_cpus)
    ours = group_run(args.model_dir, request, args.pipeline_class, args.device, args.vae_tiling, loras)
    diff = np.abs(plain.pop("frames").astype(np.float64) - ours.pop("frames").astype(np.float64))
    payload = {
        "arch": args.arch,
        "environment": environment(),
        "command": "python -m bench.model_run " + " ".join(sys.argv[1:]),
        "request": f"{args.size}, {args.frames} frame(s), {args.steps} steps, guidance {args.guidance}"
        + (", with an image" if image else "")
        + (f", a random LoRA of rank {args.lora_rank} at scale 1" if loras else "")
        + f"; the group's vae_tiling {args.vae_tiling}",
        "write_s": write_s,
        "plain": plain,
        "group": ours,
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
    }
    write_results(args.out, args.name or f"model-run-{args.arch}", payload, markdown(payload))


if __name__ == "__main__":
    main()
