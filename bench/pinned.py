"""Pinned host memory a rank keeps after its load: torch's caching host allocator keeps freed pinned
blocks (the load's staging buffers: ``staged_reads``) unless the load gives them back
(``staged_reads.release_pinned_memory``). One group of one rank on one GPU; the rank's pinned
allocator statistics once it serves.

    python -m bench.pinned --model tiny --out bench/results/pinned-after-load-1xH200.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KEYS = ("allocated_bytes.current", "allocated_bytes.peak", "num_host_alloc", "num_host_free")


def _pinned(_rank) -> dict:
    import torch

    stats = torch.cuda.host_memory_stats()
    return {key: int(stats.get(key, 0)) for key in KEYS}


def main() -> None:
    import ray
    import torch

    from ray_hsdp.config.group import GroupConfig
    from ray_hsdp.group import ShardGroup

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ray.init(num_gpus=1, include_dashboard=False)
    with ShardGroup(GroupConfig(model=args.model, device="cuda", shard_size=1)) as group:
        pinned = ray.get(group.ranks[0].__ray_call__.remote(_pinned))
    gpu = torch.cuda.get_device_name(0)
    lines = [
        "# Pinned host memory a rank keeps after its load",
        "",
        f"Command: `python -m bench.pinned --model {args.model}`; one group of one rank on one {gpu}; the rank's "
        "`torch.cuda.host_memory_stats()` once its group serves.",
        "",
        "| statistic | value |",
        "| --- | ---: |",
        *[f"| `{key}` | {value:,} |" for key, value in pinned.items()],
    ]
    text = "\n".join(lines) + "\n"
    print(text, json.dumps(pinned))
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
