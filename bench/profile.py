"""Where the time of each rank goes, per serving setup: GPU busy time by kind of kernel (torch
profiler), the tick thread's waits, and each request's phases.

    python -m bench.profile --model-dir /tmp/wan14b --frames 21 81 --out bench/results

For each setup and frame count: a warm-up, then two profiled windows: one request alone (its
latency and phases), and ``2 x GPUs`` requests at once (the throughput case of bench.throughput).
The ``ceiling`` setup is one unsharded rank on one GPU given half the requests, which is what
each GPU of the ceiling of bench.throughput runs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import ensure_model, environment, fox_requests, start_ray, write_results
from bench.throughput import BEST, FA3_VAECL, LOCAL_TEXT, latent_tokens

SETUPS = {
    "ceiling": {"shard_size": 1, "replicate_size": 2},
    "batch": {"mode": "batch"},
    "batch-streams": {"mode": "batch", "request_streams": True},
    "batch-inplace": {"mode": "batch", "gather": "in_place"},
    "batch-fsdp2": {"mode": "batch", "gather": "fsdp2"},
    "batch-compile": {"mode": "batch", "compile": True},
    "batch-inplace-compile": {"mode": "batch", "gather": "in_place", "compile": True},
    "replicated": {"mode": "replicated"},
    # The fastest options of issue 40 (FP8 linears, compile, SageAttention), and with the decode on a
    # stream of its own / the text encoder unsharded on every rank / the VAE's weights channels-last.
    "batch-best": {"mode": "batch", **BEST},
    "batch-best-streams": {"mode": "batch", "request_streams": True, **BEST},
    "batch-best-localtext": {"mode": "batch", "shard_components": LOCAL_TEXT, **BEST},
    "batch-best-vaecl": {"mode": "batch", "vae_channels_last": True, **BEST},
    # The fastest measured on Hopper (FlashAttention 3's FP8 forward, VAE channels-last), and with
    # the decode on a stream of its own.
    "batch-fa3-vaecl": {"mode": "batch", **FA3_VAECL},
    "batch-fa3-vaecl-streams": {"mode": "batch", "request_streams": True, **FA3_VAECL},
}


def phases(profile: dict) -> dict:
    """Per request of one rank: seconds to the first step's end, denoising, and after the last step."""
    out = {}
    for request_id, r in profile["requests"].items():
        if "start" not in r or "end" not in r or not r["steps"]:
            continue
        out[request_id] = {
            "to_first_step_s": round(r["steps"][0] - r["start"], 3),
            "denoise_s": round(r["steps"][-1] - r["start"], 3),
            "after_last_step_s": round(r["end"] - r["steps"][-1], 3),
            "total_s": round(r["end"] - r["start"], 3),
        }
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="wan2.1-t2v-14b")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--frames", type=int, nargs="+", default=[81])
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--guidance", type=float, default=5.0, help="guidance scale (1: unguided, one forward a step)")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--setups", nargs="+", default=["ceiling", "batch", "batch-streams"], choices=sorted(SETUPS))
    parser.add_argument(
        "--env", nargs="*", default=[], metavar="KEY=VALUE", help="environment of the ranks (NCCL settings, say)"
    )
    parser.add_argument("--tag", default="", help="suffix of the result files")
    parser.add_argument("--traces", default=None, help="folder for gzipped chrome traces (largest window only)")
    parser.add_argument("--out", default="bench/results")
    return parser


def profile_windows(group, setup: str, frames: int, args) -> list[dict]:
    """After a warm-up, one request alone and a throughput window of two per GPU, each profiled."""
    per_gpu = args.gpus // group.dims.shard_size  # the ceiling's one rank takes one GPU's share

    def requests(count: int) -> list:
        return fox_requests(
            count, width=args.width, height=args.height, frames=frames, steps=args.steps,
            guidance_scale=args.guidance, id_prefix=f"f{frames}-r",
        )  # fmt: skip

    group.generate(requests(group.dims.shard_size))  # warm-up
    rows = []
    for window, count in (("one request", 1), ("throughput", 2 * args.gpus // per_gpu)):
        traces = f"{args.traces}/{setup}-{frames}" if args.traces and window == "throughput" else None
        group.start_profile(traces)
        start = time.perf_counter()
        group.generate(requests(count))
        wall = time.perf_counter() - start
        ranks = group.stop_profile()
        rows.append(
            {
                "setup": setup,
                "frames": frames,
                "tokens": latent_tokens(args.width, args.height, frames),
                "window": window,
                "requests": count,
                "wall_s": round(wall, 3),
                "ranks": [{**r, "phases": phases(r)} for r in ranks],
            }
        )
    return rows


def main() -> None:
    args = build_parser().parse_args()

    import ray

    from ray_hsdp.config.group import GroupConfig
    from ray_hsdp.group import ShardGroup

    model_dir = Path(args.model_dir)
    ensure_model(args.arch, model_dir, args.device)
    env_vars = dict(item.split("=", 1) for item in args.env)
    start_ray(env_vars=env_vars)
    rows: list[dict] = []
    name = f"profile-{args.arch}{args.tag}"
    for setup in args.setups:
        fields = dict(SETUPS[setup])
        fields.setdefault("shard_size", args.gpus)
        group = ShardGroup(GroupConfig(model=str(model_dir), device=args.device, **fields)).start()
        try:
            for frames in args.frames:
                rows += profile_windows(group, setup, frames, args)
                payload = {
                    "rows": rows, "environment": environment(), "steps": args.steps, "guidance": args.guidance,
                    "rank_env": env_vars,
                }  # fmt: skip
                write_results(Path(args.out), name, payload, table(rows))
        finally:
            group.shutdown()
    ray.shutdown()


def table(rows: list[dict]) -> str:
    lines = [
        "# Profile: where each rank's time goes",
        "",
        f"GPUs: {', '.join(environment()['gpus']) or 'none'}",
        "",
        "GPU busy = union of all kernels over the window; compute = all but collectives; by kind = summed "
        "kernel seconds; ticks = the tick thread's wait in the tick all-gather with a forward of its own "
        "waiting (own) or none (busy).",
        "",
        "| setup | frames | window | requests | wall s | rank | GPU busy s (frac) | compute s | matmul s "
        "| attention s | conv s | collective s | other s | gaps >5ms s | gather wait own/busy s | request total s "
        "(denoise / after last step) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        for r in row["ranks"]:
            gpu = r.get("gpu", {})
            kinds = gpu.get("by_kind", {})
            ticks = r.get("ticks", {})

            def kind_s(k, kinds=kinds):
                return f"{kinds[k]['kernel_s']:.2f}" if k in kinds else "-"

            waits = "/".join(f"{ticks[k]['gather_s']:.2f}" if k in ticks else "-" for k in ("own", "busy"))
            reqs = "; ".join(
                f"{p['total_s']:.1f} ({p['denoise_s']:.1f} / {p['after_last_step_s']:.1f})"
                for p in r["phases"].values()
            )
            busy = f"{gpu['busy_s']:.2f} ({gpu['busy_fraction']:.2f})" if "busy_s" in gpu else "-"
            lines.append(
                f"| {row['setup']} | {row['frames']} | {row['window']} | {row['requests']} | {row['wall_s']:.2f} "
                f"| {r['rank']} | {busy} | {gpu.get('compute_busy_s', '-')} | {kind_s('matmul')} "
                f"| {kind_s('attention')} | {kind_s('conv')} | {kind_s('collective')} | {kind_s('other')} "
                f"| {gpu.get('gaps_over_5ms', {}).get('total_s', '-')} | {waits} | {reqs} |"
            )
    lines += ["", f"Command: `{environment()['command']}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
