"""The Wan VAE's decode of one video on 1, 2 and 4 GPUs: whole, tiled, and tiled split over a lane.

    python -m bench.decode --ranks 1 2 4 --sizes 1280x720 832x480 --frames 81 --out bench/results

The VAE is the Wan2.1 one at its real size with seeded random weights (``AutoencoderKLWan()``:
the same on every rank), in the served dtype (bf16 on CUDA); latents are seeded. For each size:
on one GPU the untiled decode (``vae.decode``) and diffusers' tiled decode (``enable_tiling``, its
default 256-pixel tiles every 192); on N > 1 GPUs, a lane of N ranks sharing the tiled decode as
served (``ray_hsdp.lane_tiles``, the Wan policy's split, tiles exchanged over gloo), with the largest difference of
its frames to the one-GPU tiled decode. Each measurement follows a warm-up of two latent frames at
the same size; times are wall seconds with CUDA synchronised, peaks are ``max_memory_allocated``
per rank (the VAE's weights included). No Ray: ``torch.multiprocessing`` starts the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench.common import environment, gib, write_results


def _vae(device: str, dtype):
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    if device == "cuda":
        return AutoencoderKLWan().to(device, dtype).eval()
    # CPU dry run: a narrow VAE of the same structure.
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1).to(dtype).eval()


def _latents(size: str, frames: int, dtype, device: str, latent_frames: int | None = None):
    import torch

    width, height = (int(x) for x in size.split("x"))
    shape = (1, 16, latent_frames or (frames - 1) // 4 + 1, height // 8, width // 8)
    return torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)


def _timed(device: str, fn, *args):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return out, time.perf_counter() - start, peak


def _rank(rank: int, world: int, args, port: int, scratch: str) -> None:
    import torch
    import torch.distributed as dist

    from ray_hsdp.distributed import NCCL_ENV
    from ray_hsdp.lane_tiles import LaneTiles
    from ray_hsdp.sharding.policy import decode_split_for

    os.environ.update(NCCL_ENV)
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    vae = _vae(device, dtype)
    split = decode_split_for(vae)
    # As served: the lane's exchange on a gloo group of its own (lane_decode_group).
    lane = LaneTiles(dist.new_group(backend="gloo"), rank, world, device)

    def one_gpu(latents):  # whole or tiled, as vae.use_tiling says
        return vae.decode(latents).sample

    def shared(latents):
        return lane.run(lambda: split.decode(vae, latents, lane))

    rows = []
    with torch.no_grad():
        for size in args.sizes:
            z = _latents(size, args.frames, dtype, device)
            warm = _latents(size, args.frames, dtype, device, latent_frames=2)
            reference = Path(scratch) / f"tiled-{size}.pt"
            if world == 1:
                vae.disable_tiling()
                vae.decode(warm)
                _, whole_s, whole_peak = _timed(device, one_gpu, z)
                vae.enable_tiling()
                vae.decode(warm)
                tiled, tiled_s, tiled_peak = _timed(device, one_gpu, z)
                torch.save(tiled.cpu(), reference)
                rows.append({"size": size, "ranks": 1, "how": "whole", "seconds": whole_s, "peaks": [whole_peak]})
                rows.append({"size": size, "ranks": 1, "how": "tiled", "seconds": tiled_s, "peaks": [tiled_peak]})
                del tiled
                continue
            vae.enable_tiling()
            shared(warm)
            dist.barrier()
            out, seconds, peak = _timed(device, shared, z)
            peaks = [None] * world
            dist.all_gather_object(peaks, peak)
            if rank == 0:
                diff = None
                if reference.exists():
                    diff = float((out.float().cpu() - torch.load(reference).float()).abs().max())
                rows.append(
                    {"size": size, "ranks": world, "how": "split", "seconds": seconds, "peaks": peaks, "diff": diff}
                )
            del out
            if device == "cuda":
                torch.cuda.empty_cache()
    if rank == 0:
        (Path(scratch) / f"rows-{world}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def markdown(rows: list[dict], args) -> str:
    env = environment()
    lines = [
        f"# Wan2.1 VAE decode, {args.frames} frames, random {'bf16' if args.device == 'cuda' else 'fp32 narrow'} "
        "weights: whole, tiled, and tiled split over a lane",
        "",
        f"GPUs: {', '.join(env['gpus']) or 'none (CPU dry run)'}; torch {env['torch']}, diffusers {env['diffusers']}.",
        f"Command: `{env['command']}`",
        "",
        "| size | ranks | decode | seconds | vs one GPU whole | peak per rank GiB | max abs diff to one-GPU tiled |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    whole = {r["size"]: r["seconds"] for r in rows if r["how"] == "whole"}
    for r in sorted(rows, key=lambda r: (r["size"], r["ranks"], r["how"] != "whole")):
        base = whole.get(r["size"])
        ratio = f"{base / r['seconds']:.2f}x" if base else ""
        peak = max((p for p in r["peaks"] if p is not None), default=None)
        diff = "" if r.get("diff") is None else f"{r['diff']:.2e}"
        lines.append(
            f"| {r['size']} | {r['ranks']} | {r['how']} | {r['seconds']:.2f} | {ratio} | "
            f"{gib(peak) if peak is not None else ''} | {diff} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sizes", nargs="+", default=["1280x720", "832x480"])
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run with a narrow VAE on gloo")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="decode-wan2.1-vae")
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from ray_hsdp.distributed import free_port

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch:
        for world in sorted(args.ranks):  # one GPU first: its tiled decode is the split's reference
            mp.spawn(_rank, args=(world, args, free_port("127.0.0.1"), scratch), nprocs=world, join=True)
            rows += json.loads((Path(scratch) / f"rows-{world}.json").read_text())
            # Written after every rank count, so that a run cut short keeps what it measured.
            write_results(args.out, args.name, {"rows": rows, "environment": environment()}, markdown(rows, args))


if __name__ == "__main__":
    main()
