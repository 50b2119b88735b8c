"""A video job the way a user runs one: ``serve run`` of a committed YAML, then OpenAI's own client
creating, polling and downloading the video over HTTP; with ``--plain``, the same request through
plain diffusers on the same GPU afterwards, in the same run.

    python -m bench.video_http --config serve_configs/wan2.1_t2v_14b_fast_1gpu.yaml --model /tmp/wan14b \
        --steps 8 --plain

``--model`` points the YAML's ``model`` at the local checkpoint and ``--set FIELD=VALUE`` changes
any other field of its ``args`` (a copy of the YAML is served). The server gets a fresh API key in
its environment (``RAY_HSDP_API_KEY``), as a YAML that listens on every address asks.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import ServedYaml, environment, first_frame_png, write_results

PROMPT = "A red fox runs through fresh snow at dawn, cinematic"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", type=Path, default=Path("serve_configs/wan2.1_t2v_14b_fast_1gpu.yaml"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--size", default="832x480")
    parser.add_argument("--seconds", default="5", help="5 s at 16 fps: 81 frames")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="video-http-wan2.1-t2v-14b")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a field of the args")
    parser.add_argument("--plain", action="store_true", help="then the same request through plain diffusers")
    parser.add_argument("--jobs", type=int, default=1, help="jobs one after the other (the first compiles its shape)")
    parser.add_argument(
        "--image", action="store_true", help="image-to-video: send the bench's synthetic first frame as input_reference"
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()

    import openai

    from ray_hsdp.request import parse_size
    from ray_hsdp.serve.media import decode_mp4

    server = ServedYaml(args.config, args.model, args.set, args.out, args.name)
    args.device = server.device
    with server:
        ready_s, args.start_phases, base, key = server.ready_s, server.phases, server.base, server.key
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, timeout=1800, max_retries=0)
        # As a user sends a file: the openai client makes it a part of a multipart form.
        image = {"input_reference": ("first.png", first_frame_png(*parse_size(args.size)), "image/png")}
        earlier = []  # (id, seconds) of the jobs before the last
        for _ in range(args.jobs):
            created_at = time.perf_counter()
            video = client.videos.create(
                prompt=PROMPT,
                size=args.size,
                seconds=args.seconds,
                extra_body={"num_inference_steps": args.steps, "seed": 0},
                **(image if args.image else {}),
            )
            progress = []
            while video.status in ("queued", "in_progress"):
                time.sleep(0.5)
                video = client.videos.retrieve(video.id)
                progress.append((round(time.perf_counter() - created_at, 1), video.status, video.progress))
            job_s = time.perf_counter() - created_at
            earlier.append((video.id, round(job_s, 2)))
        earlier.pop()
        mp4 = client.videos.download_content(video.id).read()
        frames, fps = decode_mp4(mp4)
        # Written before the server stops: its shutdown can take a minute.
        report(args, ready_s, video, job_s, earlier, progress, mp4, frames, fps)
    if args.plain:
        plain = run_plain_request(args, video, frames)
        report(args, ready_s, video, job_s, earlier, progress, mp4, frames, fps, plain=plain)


def run_plain_request(args, video, served_frames) -> dict:
    """The served request through plain diffusers on this GPU (loaded, warmed, then timed as
    ``bench.lanes`` does), and how far the served MP4's frames are from its frames."""
    import numpy as np

    from bench.lanes import run_plain
    from ray_hsdp.request import GenerationRequest, parse_size

    width, height = parse_size(args.size)
    request = GenerationRequest(
        prompt=PROMPT, width=width, height=height, num_frames=video.num_frames, request_id="plain",
        num_inference_steps=video.num_inference_steps, guidance_scale=video.guidance_scale, seed=video.seed,
        image=first_frame_png(width, height) if args.image else None,
    )  # fmt: skip
    started = time.perf_counter()
    rows, frames, _ = run_plain(Path(args.model), [request], args.device)
    plain = np.asarray(frames[0][0], dtype=np.float32)  # (frames, H, W, 3) in [0, 1]
    served = np.asarray(served_frames, dtype=np.float32) / 255.0
    diff = np.abs(served[: len(plain)] - plain)
    return {
        **rows[0],
        "load_and_warm_s": round(time.perf_counter() - started - rows[0]["request_s"], 1),
        "frames_mean_abs_diff": round(float(diff.mean()), 4),
        "frames_max_abs_diff": round(float(diff.max()), 4),
    }


def report(args, ready_s, video, job_s, earlier, progress, mp4, frames, fps, plain: dict | None = None) -> None:
    payload = {
        "environment": environment(),
        "config": str(args.config),
        "server_ready_s": round(ready_s, 1),
        "group_start_phases_s": args.start_phases,
        "video": video.model_dump(),
        "job_s": round(job_s, 2),
        "earlier_jobs_s": earlier,
        "progress": progress,
        "mp4_bytes": len(mp4),
        "decoded_frames": list(frames.shape),
        "fps": fps,
        "overrides": args.set,
        "plain_diffusers": plain,
    }
    markdown = "\n".join(
        [
            f"# Video job over HTTP: `serve run {args.config}` and the openai client",
            "",
            f"GPUs: {', '.join(payload['environment']['gpus']) or 'none'}",
            f"Command: `{payload['environment']['command']}`",
            "",
            f"- server up (group loaded) after {ready_s:.1f} s",
            f"- the group's start: {', '.join(f'{k} {v:.1f} s' for k, v in args.start_phases.items())}",
            f"- job {video.id}{' (image to video)' if args.image else ''}: {video.status}, {args.size}, "
            f"{args.seconds} s, {args.steps} steps: "
            f"{job_s:.1f} s from create to completed",
            f"- MP4: {len(mp4) / 2**20:.2f} MiB, decodes to {frames.shape[0]} frames of "
            f"{frames.shape[2]}x{frames.shape[1]} at {fps:g} fps",
            *[f"- an earlier job of the same request: {s:.1f} s ({s / job_s:.2f}x the last)" for _, s in earlier],
            f"- progress seen: {', '.join(str(p[2]) for p in progress)}",
            *([f"- overrides: {' '.join(args.set)}"] if args.set else []),
            "",
            *(plain_lines(plain, job_s) if plain else []),
        ]
    )
    write_results(args.out, args.name, payload, markdown)


def plain_lines(plain: dict, job_s: float) -> list[str]:
    return [
        "Plain diffusers, the same request on the same GPU afterwards (`from_pretrained(...).to('cuda')`, bf16,",
        "SDPA, warmed up first; its time is the pipeline call, without HTTP or MP4 encoding):",
        "",
        f"- pipeline call {plain['request_s']:.1f} s (denoising {plain['denoising_s']:.1f} s); served job "
        f"{job_s:.1f} s create to completed: {plain['request_s'] / job_s:.2f}x",
        f"- served MP4 frames vs plain frames: mean abs {plain['frames_mean_abs_diff']}, max abs "
        f"{plain['frames_max_abs_diff']} (in [0, 1]; MP4 encoding included)",
        "",
    ]


if __name__ == "__main__":
    main()
