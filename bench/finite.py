"""Whether a group's frames stay finite: one short request per setting, its NaN count, no reference.

    python -m bench.finite --model-dir /tmp/wan14b --shard-size 4 --sizes 832x480 --frames 81 \\
        --set attention_backend='"sage"' --set quantization='"fp8"'

A quick probe for a pair of options whose outputs may break (fp8 with the sage attention backend
gave all-NaN frames on Wan2.1-14B until cross-attentions kept SDPA): it needs no plain diffusers run,
so it costs a group's start and one step per size. A group answers frames that are not finite with
``NonFiniteOutputError``, whose message (how many values) is the row's. ``--set FIELD=JSON`` sets a
``GroupConfig`` field (repeatable); ``--compare`` also runs the group without those fields and
reports the largest difference of the frames.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import ensure_model, environment, fox_requests, start_ray, write_results


def frames_of(config, sizes, frames: int, steps: int, deadline_s: float) -> dict:
    """Size -> the frames (a float32 array) of one request of that size on a group of ``config``,
    or the ``NonFiniteOutputError`` it answered."""
    import numpy as np

    from ray_hsdp.group import ShardGroup
    from ray_hsdp.request import NonFiniteOutputError

    out = {}
    with ShardGroup(config) as group:
        for size in sizes:
            width, height = (int(x) for x in size.split("x"))
            request = fox_requests(1, width=width, height=height, frames=frames, steps=steps)[0]
            try:
                out[size] = np.asarray(group.submit(request).result(timeout=deadline_s).frames, dtype=np.float32)
            except NonFiniteOutputError as err:
                out[size] = err
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="wan2.1-t2v-14b")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/wan14b"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shard-size", type=int, default=2)
    parser.add_argument("--sizes", nargs="+", default=["832x480"])
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", help="a GroupConfig field")
    parser.add_argument("--compare", action="store_true", help="also run without the --set fields")
    parser.add_argument("--ray-cpus", type=int, default=None, help="a Ray of its own with this many CPUs (CPU runs)")
    parser.add_argument("--request-deadline", type=float, default=300)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="finite")
    args = parser.parse_args()

    from ray_hsdp.config.group import GroupConfig

    fields = {key: json.loads(value) for key, value in (s.split("=", 1) for s in args.set)}
    ensure_model(args.arch, args.model_dir, args.device)
    start_ray(args.ray_cpus)
    base = {"model": str(args.model_dir), "device": args.device, "shard_size": args.shard_size}
    work = (args.sizes, args.frames, args.steps, args.request_deadline)
    probed = frames_of(GroupConfig(**base, **fields), *work)
    plain = frames_of(GroupConfig(**base), *work) if args.compare else {}
    rows = []
    for size, out in probed.items():
        if isinstance(out, Exception):
            rows.append({"size": size, "finite": False, "error": str(out)})
            continue
        row = {"size": size, "finite": True}
        if isinstance(plain.get(size), Exception):
            row["error"] = f"without the fields: {plain[size]}"
        elif size in plain:
            row["max_abs_diff_without"] = float(abs(out - plain[size]).max())
        rows.append(row)
    lines = [
        f"# Finite frames: {args.arch}, {args.frames} frames, {args.steps} steps, "
        f"shard_size {args.shard_size}, {fields}",
        "",
        "| size | finite | max abs diff without the fields | error |",
        "| --- | --- | --- | --- |",
        *(
            f"| {r['size']} | {r['finite']} | {r.get('max_abs_diff_without', '')} | {r.get('error', '')} |"
            for r in rows
        ),
    ]
    payload = {"rows": rows, "fields": fields, "environment": environment()}
    write_results(args.out, args.name, payload, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
