"""One video request end to end on a shard group: time and peak memory per phase.

    python -m bench.video --model-dir /tmp/wan14b --sizes 832x480 1280x720 --frames 81 --steps 2

Phases, from the rank's profile (``ray_hsdp.rank.profiling``: a time and a peak at each step's end and
at the request's end): text encoding (start to the first step's end, less one step), denoising
(the steps), VAE decode (last step to end), and the MP4 encoding (in this process, as a replica
does it). Peak memory per phase: start to the first step's end (encoder and first step),
the other steps, the decode. Each size runs with the VAE's tiling off and on, so the tiling rule
(``vae_tiling_above_pixels``) comes from a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from bench.common import ensure_model, environment, gib, start_ray, write_results


def phases(record: dict) -> dict:
    steps, end = record["steps"], record["end"]
    step_s = (steps[-1] - steps[0]) / (len(steps) - 1) if len(steps) > 1 else 0.0
    encode_s = steps[0] - record["start"] - step_s
    peaks = record["step_peaks"]  # None on CPU
    return {
        "text_encoding_s": round(encode_s, 3),
        "denoising_s": round(steps[-1] - record["start"] - encode_s, 3),
        "step_s": round(step_s, 3),
        "vae_decode_s": round(end - steps[-1], 3),
        "peak_encode_and_first_step_bytes": peaks[0],
        "peak_denoising_bytes": max(peaks[1:], default=peaks[0]) if peaks[0] is not None else None,
        "peak_decode_bytes": record["end_peak"],
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="wan2.1-t2v-14b")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/wan14b"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shard-size", type=int, default=2)
    parser.add_argument("--sizes", nargs="+", default=["832x480", "1280x720"])
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tiling", nargs="+", default=["off", "on"])
    parser.add_argument("--tiled-sizes", nargs="+", default=None, help="sizes run with tiling on (default: --sizes)")
    parser.add_argument(
        "--warmup", action="store_true", help="one 1-step request first, so that no phase pays the first kernels"
    )
    parser.add_argument("--ray-cpus", type=int, default=None, help="a Ray of its own with this many CPUs (CPU runs)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="video-wan2.1-t2v-14b")
    return parser


def measure(group, size: str, tiling: str, args) -> dict:
    """One request of ``size`` on ``group``, profiled: its phases, its MP4 encode, or its error."""
    from ray_hsdp.request import GenerationRequest, parse_size
    from ray_hsdp.serve.media import encode_mp4

    width, height = parse_size(size)
    request = GenerationRequest(
        prompt="A red fox runs through fresh snow at dawn, cinematic",
        width=width,
        height=height,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        guidance_scale=5.0,
        seed=0,
        request_id=f"{size}-{tiling}",
        uint8_frames=True,
    )
    group.start_profile()
    started = time.perf_counter()
    try:
        result = group.submit(request).result()
        error = None
    except Exception as err:  # noqa: BLE001 - an out-of-memory decode is a result here
        result, error = None, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    total_s = time.perf_counter() - started
    profiles = group.stop_profile()
    record = next(p["requests"][request.request_id] for p in profiles if request.request_id in p["requests"])
    row = {"size": size, "frames": args.frames, "steps": args.steps, "vae_tiling": tiling}
    row.update(total_s=round(total_s, 3), error=error)
    if result is not None:
        row.update(phases(record))
        encode_started = time.perf_counter()
        mp4 = encode_mp4(result.frames[0], 16)
        row.update(mp4_encode_s=round(time.perf_counter() - encode_started, 3), mp4_bytes=len(mp4))
    return row


def markdown(payload: dict, args) -> str:
    weights, rows = payload["parameter_bytes_per_rank"], payload["rows"]
    lines = [
        f"# Video end to end: {args.arch}, S={args.shard_size}, {args.frames} frames, {args.steps} steps, guidance on",
        "",
        f"GPUs: {', '.join(payload['environment']['gpus']) or 'none'}; parameters per rank (GiB): "
        + ", ".join(gib(w) for w in weights),
        f"Command: `{payload['environment']['command']}`",
        "",
        "| size | VAE tiling | text encoding s | denoising s (per step) | VAE decode s | MP4 encode s | total s | "
        "peak GiB: encode+step 1 / denoising / decode | error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['size']} | {r['vae_tiling']} | | | | | {r['total_s']} | | {r['error']} |")
            continue
        peaks = " / ".join(
            gib(r[k]) if r[k] is not None else "-"
            for k in ("peak_encode_and_first_step_bytes", "peak_denoising_bytes", "peak_decode_bytes")
        )
        lines.append(
            f"| {r['size']} | {r['vae_tiling']} | {r['text_encoding_s']} | {r['denoising_s']} ({r['step_s']}) | "
            f"{r['vae_decode_s']} | {r['mp4_encode_s']} | {r['total_s']} | {peaks} | |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    args = build_parser().parse_args()

    import ray

    from ray_hsdp.config.group import GroupConfig
    from ray_hsdp.group import ShardGroup
    from ray_hsdp.request import GenerationRequest, parse_size

    written_s = ensure_model(args.arch, args.model_dir, args.device)
    if args.warmup:
        print("warming up with one 1-step request", flush=True)
    start_ray(args.ray_cpus)
    rows, weights = [], []
    for tiling in args.tiling:
        config = GroupConfig(
            model=str(args.model_dir), device=args.device, shard_size=args.shard_size, requests_per_rank=1,
            vae_tiling=tiling,
        )  # fmt: skip
        with ShardGroup(config) as group:
            memory = group.memory()
            if args.warmup:
                width, height = parse_size(args.sizes[0])
                warm = GenerationRequest(prompt="warm up", width=width, height=height, num_frames=args.frames)
                group.generate([dataclasses.replace(warm, num_inference_steps=1, uint8_frames=True)])
            for size in args.tiled_sizes or args.sizes if tiling == "on" else args.sizes:
                rows.append(measure(group, size, tiling, args))
                print(rows[-1], flush=True)
            weights = [r["total"]["sharded_local"] + r["total"]["replicated"] for r in memory]
        if group.failure:
            break
    payload = {
        "environment": environment(),
        "arch": args.arch,
        "shard_size": args.shard_size,
        "checkpoint_written_s": written_s,
        "parameter_bytes_per_rank": weights,
        "rows": rows,
    }
    write_results(args.out, args.name, payload, markdown(payload, args))
    ray.shutdown()


if __name__ == "__main__":
    main()
