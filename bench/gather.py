"""One unit's gather on N GPUs: NCCL's all-gather against reading the peers' rows (``gather: peer``),
alone and beside a matrix multiply, to see what each costs the compute next to it.

    python -m bench.gather --ranks 4 --unit-mib 700 --out bench/results

Each rank holds ``1/N`` of a unit of ``--unit-mib`` MiB (a Wan-14B block is about 700 MiB in bf16)
and gathers the whole unit: by ``all_gather_into_tensor`` (NCCL), and by copying the other ranks'
rows out of their memory (``PeerMemory``: symmetric memory, one copy stream per peer, as
``InPlaceUnits`` does). Then a bf16 matmul loop of about a block's compute runs alone and with each
gather issued beside every multiply. Ranks start as Ray starts them: one process per GPU, each seeing
only its own (``CUDA_VISIBLE_DEVICES``). Times are medians of ``--repeats``, CUDA synchronised.
On CPU (a dry run) the ranks use gloo and shared memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import environment, write_results


def _median_s(device: str, fn, repeats: int) -> float:
    import torch

    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _rank(rank: int, world: int, args, port: int, scratch: str) -> None:
    if args.device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    import torch
    import torch.distributed as dist

    from ray_hsdp.sharding.peer_memory import PeerMemory

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        **({"device_id": device} if args.device == "cuda" else {}),
    )
    group = dist.group.WORLD
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    unit_bytes = args.unit_mib * 2**20 // world * world
    mine = unit_bytes // world
    window = PeerMemory.allocate(mine, group, device)
    window.local.copy_(torch.full((mine,), rank, dtype=torch.uint8))
    window.published()
    received = torch.empty(unit_bytes, dtype=torch.uint8, device=device)
    streams = [torch.cuda.Stream() for _ in range(world - 1)] if args.device == "cuda" else []

    def nccl():
        dist.all_gather_into_tensor(received, window.local, group=group)

    def peer():
        if not streams:
            for r in range(world):
                received[r * mine : (r + 1) * mine].copy_(window.peers[r])
            return
        compute = torch.cuda.current_stream()
        events = []
        for step, stream in enumerate(streams):
            source = (rank + 1 + step) % world
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                received[source * mine : (source + 1) * mine].copy_(window.peers[source], non_blocking=True)
                if step == 0:
                    received[rank * mine : (rank + 1) * mine].copy_(window.local, non_blocking=True)
            events.append(stream.record_event())
        for event in events:
            event.wait()

    n = args.matmul
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)

    def matmuls():
        for _ in range(args.multiplies):
            a @ b

    def beside(gather):
        def run():
            # As a unit's prefetch: the gather issued, then the compute that does not wait for it.
            for _ in range(args.multiplies):
                if args.device == "cuda":
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        gather()
                    a @ b
                    torch.cuda.current_stream().wait_stream(side)
                else:
                    gather()
                    a @ b

        return run

    row = {"rank": rank, "unit_bytes": unit_bytes}
    for name, fn in [("nccl", nccl), ("peer", peer)]:
        row[f"{name}_s"] = _median_s(args.device, fn, args.repeats)
        expected = torch.arange(world, dtype=torch.uint8, device=device).repeat_interleave(mine)
        row[f"{name}_correct"] = bool(torch.equal(received, expected))
        received.zero_()
        dist.barrier()
    row["matmul_s"] = _median_s(args.device, matmuls, args.repeats)
    dist.barrier()
    row["matmul_beside_nccl_s"] = _median_s(args.device, beside(nccl), args.repeats)
    dist.barrier()
    row["matmul_beside_peer_s"] = _median_s(args.device, beside(peer), args.repeats)
    Path(scratch, f"{rank}.json").write_text(__import__("json").dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--unit-mib", type=int, default=700)
    parser.add_argument("--matmul", type=int, default=8192, help="side of the square bf16 matrices multiplied")
    parser.add_argument("--multiplies", type=int, default=16, help="multiplies per timed loop")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()

    import json
    import socket

    import torch.multiprocessing as mp

    runs = []
    for world in args.ranks:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with tempfile.TemporaryDirectory() as scratch:
            mp.spawn(_rank, args=(world, args, port, scratch), nprocs=world, join=True)
            ranks = [json.loads(Path(scratch, f"{r}.json").read_text()) for r in range(world)]
        runs.append({"ranks": world, "per_rank": ranks})
        write_results(Path(args.out), "gather", {"runs": runs, "environment": environment()}, _table(runs, args))


def _table(runs, args) -> str:
    lines = [
        f"# One unit's gather ({args.unit_mib} MiB): NCCL all-gather against peer copies, and a matmul beside each",
        "",
        f"GPUs: {', '.join(environment()['gpus']) or 'none'}",
        "",
        "| ranks | NCCL gather ms (GB/s in) | peer gather ms (GB/s in) | both correct | matmuls alone ms "
        "| beside NCCL ms | beside peer ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        worst = {k: max(r[k] for r in run["per_rank"]) for k in run["per_rank"][0] if k.endswith("_s")}
        incoming = run["per_rank"][0]["unit_bytes"] * (run["ranks"] - 1) / run["ranks"]
        correct = all(r["nccl_correct"] and r["peer_correct"] for r in run["per_rank"])
        lines.append(
            f"| {run['ranks']} | {worst['nccl_s'] * 1e3:.2f} ({incoming / worst['nccl_s'] / 1e9:.0f}) "
            f"| {worst['peer_s'] * 1e3:.2f} ({incoming / worst['peer_s'] / 1e9:.0f}) | {correct} "
            f"| {worst['matmul_s'] * 1e3:.1f} | {worst['matmul_beside_nccl_s'] * 1e3:.1f} "
            f"| {worst['matmul_beside_peer_s'] * 1e3:.1f} |"
        )
    lines += ["", f"Command: `{environment()['command']}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
