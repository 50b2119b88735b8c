"""The Wan VAE's decode of one video on 1, 2 and 4 GPUs: whole, tiled, and shared over a lane.

    python -m bench.decode --ranks 1 2 4 --sizes 1280x720 832x480 --frames 81 --out bench/results

The VAE is the Wan2.1 one at its real size with seeded random weights (``AutoencoderKLWan()``:
the same on every rank), in the served dtype (bf16 on CUDA); latents are seeded. For each size:
on one GPU the untiled decode (``vae.decode``) and diffusers' tiled decode (``enable_tiling``, its
default 256-pixel tiles every 192); on N > 1 GPUs, a lane of N ranks as served: sharing the tiled
decode's tiles (``split``: ``vae_parallel: on``, the Wan policy's split, tiles exchanged over gloo),
with the largest difference of its frames to the one-GPU tiled decode, and sharing the whole decode
by bands of rows (``rows``: ``vae_parallel: rows``), with the largest difference to the one-GPU
whole decode. Each measurement follows a warm-up of two latent frames at the same size; times are
wall seconds with CUDA synchronised, peaks are ``max_memory_allocated`` per rank (the VAE's
weights included). No Ray: ``torch.multiprocessing`` starts the ranks.
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


def _one_gpu(vae, z, warm, size: str, device: str, scratch: str) -> list[dict]:
    """The whole and the tiled decode on one GPU; both saved as the lane decodes' references."""
    import torch

    out = []
    for how, tiling in (("whole", False), ("tiled", True)):
        vae.enable_tiling() if tiling else vae.disable_tiling()
        vae.decode(warm)
        frames, seconds, peak = _timed(device, lambda latents: vae.decode(latents).sample, z)
        torch.save(frames.cpu(), Path(scratch) / f"{how}-{size}.pt")
        out.append({"size": size, "ranks": 1, "how": how, "seconds": seconds, "peaks": [peak]})
        del frames
    return out


def _lane(vae, split, lane, z, warm, size: str, args, scratch: str) -> list[dict]:
    """The lane's shared decodes of ``z``: tiles (against the one-GPU tiled decode) and bands of
    rows (against the one-GPU whole decode), as served (``LaneTiles.run``)."""
    import torch
    import torch.distributed as dist

    from ray_hsdp.sharding.policies import wan_vae

    out = []
    runs = [("split", split.decode, True, "tiled", None)]
    runs += [("rows", split.rows, False, "whole", extension) for extension in args.extensions]
    for how, decode, tiling, reference, extension in runs:
        if how not in args.lane_decodes:
            continue
        vae.enable_tiling() if tiling else vae.disable_tiling()
        if extension is not None:  # the rows a band carries at each scale after the latents'
            wan_vae._EXTENSION = extension

        def shared(latents, decode=decode):
            return lane.run(lambda: decode(vae, latents, lane))

        shared(warm)
        dist.barrier()
        exchanges = lane.exchanges
        frames, seconds, peak = _timed(args.device, shared, z)
        per_frame = (lane.exchanges - exchanges) / z.shape[2]
        peaks = [None] * lane.size
        dist.all_gather_object(peaks, peak)
        if lane.leads:
            path, diff = Path(scratch) / f"{reference}-{size}.pt", None
            if path.exists():
                diff = float((frames.float().cpu() - torch.load(path).float()).abs().max())
            name = how if extension is None else f"{how} (extension {extension})"
            out.append(
                {"size": size, "ranks": lane.size, "how": name, "seconds": seconds, "peaks": peaks, "diff": diff}
                | {"exchanges_per_latent_frame": per_frame if extension is not None else None}
            )
        del frames
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return out


def _rank(rank: int, world: int, args, port: int, scratch: str) -> None:
    import torch
    import torch.distributed as dist

    from ray_hsdp.distributed import NCCL_ENV
    from ray_hsdp.pipeline.lane_tiles import LaneTiles
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
    if args.channels_last:  # as vae_channels_last serves it
        torch.nn.utils.convert_conv3d_weight_memory_format(vae, torch.channels_last_3d)
    split = decode_split_for(vae)
    # As served: the lane's exchange on a gloo group of its own (lane_decode_group).
    lane = LaneTiles(dist.new_group(backend="gloo"), rank, world, device)
    rows = []
    with torch.no_grad():
        for size in args.sizes:
            z = _latents(size, args.frames, dtype, device)
            warm = _latents(size, args.frames, dtype, device, latent_frames=2)
            if world == 1:
                rows += _one_gpu(vae, z, warm, size, device, scratch)
            else:
                rows += _lane(vae, split, lane, z, warm, size, args, scratch)
    if rank == 0:
        (Path(scratch) / f"rows-{world}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def markdown(rows: list[dict], args) -> str:
    env = environment()
    lines = [
        f"# Wan2.1 VAE decode, {args.frames} frames, random {'bf16' if args.device == 'cuda' else 'fp32 narrow'} "
        "weights: whole, tiled, and shared over a lane (split: the tiled decode's tiles; rows: bands of the whole "
        "decode's rows)",
        "",
        f"GPUs: {', '.join(env['gpus']) or 'none (CPU dry run)'}; torch {env['torch']}, diffusers {env['diffusers']}.",
        f"Command: `{env['command']}`",
        "",
        "| size | ranks | decode | seconds | vs one GPU whole | peak per rank GiB | max abs diff to one GPU's "
        "(split: tiled; rows: whole) | exchanges per latent frame |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    whole = {r["size"]: r["seconds"] for r in rows if r["how"] == "whole"}
    for r in sorted(rows, key=lambda r: (r["size"], r["ranks"], r["how"] != "whole")):
        base = whole.get(r["size"])
        ratio = f"{base / r['seconds']:.2f}x" if base else ""
        peak = max((p for p in r["peaks"] if p is not None), default=None)
        diff = "" if r.get("diff") is None else f"{r['diff']:.2e}"
        lines.append(
            f"| {r['size']} | {r['ranks']} | {r['how']} | {r['seconds']:.2f} | {ratio} | "
            f"{gib(peak) if peak is not None else ''} | {diff} | {r.get('exchanges_per_latent_frame') or ''} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sizes", nargs="+", default=["1280x720", "832x480"])
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run with a narrow VAE on gloo")
    parser.add_argument("--lane-decodes", nargs="+", default=["split", "rows"], choices=["split", "rows"])
    parser.add_argument(
        "--extensions", nargs="+", type=int, default=[6],
        help="rows: the rows a band carries on each side at each scale after the latents' (wan_vae._EXTENSION), "
        "one timed decode each",
    )  # fmt: skip
    parser.add_argument("--channels-last", action="store_true", help="the VAE's Conv3d weights channels-last")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="decode-wan2.1-vae")
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from bench.common import free_port

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch:
        for world in sorted(args.ranks):  # one GPU first: its tiled decode is the split's reference
            mp.spawn(_rank, args=(world, args, free_port("127.0.0.1"), scratch), nprocs=world, join=True)
            rows += json.loads((Path(scratch) / f"rows-{world}.json").read_text())
            # Written after every rank count, so that a run cut short keeps what it measured.
            write_results(args.out, args.name, {"rows": rows, "environment": environment()}, markdown(rows, args))


if __name__ == "__main__":
    main()
