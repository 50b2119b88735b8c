"""Weights per GPU of a real-size architecture at several shard sizes, without GPUs or files.

    python -m bench.weights --archs qwen-image flux.2-dev hunyuanvideo-1.5 wan2.2-ti2v-5b --shard-sizes 1 2 4

Each component is built at its real size on the meta device (``make-random``'s architectures and
real parts) and the components a group shards (``GroupConfig.shard_components``) are sharded by
the same code and policies as a rank's (``ray_hsdp.sharding``), over a mesh of S ranks of torch's
fake process group; the bytes are those rank 0 then holds (``ray_hsdp.memory.module_memory``: its
shards, which FSDP2 pads to S equal rows, plus what stays whole). The others (VAEs) are counted
whole. A computation of what a rank allocates for its weights, not a measurement of a GPU: a group
also holds its gathered units during a forward, its activations and its decode (``bench.memory``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import environment, write_results

GIB = 2**30


def large_parts(arch_name: str) -> dict:
    """Component name -> a builder of its real-size module on the meta device in bf16: the
    transformer(s) and the large text encoders (each built anew: sharding changes a module)."""
    import diffusers

    from ray_hsdp.checkpoints.architectures import get_architecture
    from ray_hsdp.checkpoints.real_parts import REAL_PARTS

    arch = get_architecture(arch_name)
    model_cls = getattr(diffusers, arch.transformer_class)
    _, large = REAL_PARTS[arch.family](arch.transformer)
    builders = {expert: (lambda: model_cls(**arch.transformer)) for expert in arch.experts}
    builders.update({name: (lambda cls=cls, config=config: cls(config)) for name, (cls, config) in large.items()})
    return builders


def on_meta(build):
    import torch
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        module = build()
    if hasattr(module, "tie_weights"):  # as transformers does at load: a shared embedding is one tensor
        module.tie_weights()
    return module.to(torch.bfloat16)


def whole_bytes(arch_name: str) -> dict[str, int]:
    """Bytes of the parts a group keeps whole (the VAE; FLUX.1's CLIP) in bf16, the dtype a group
    of ``dtype: bfloat16`` loads every component in."""
    from ray_hsdp.checkpoints.architectures import get_architecture
    from ray_hsdp.checkpoints.real_parts import REAL_PARTS

    arch = get_architecture(arch_name)
    whole, _ = REAL_PARTS[arch.family](arch.transformer)
    return {name: sum(p.numel() for p in m.parameters()) * 2 for name, m in whole.items()}


def rank_bytes(module, shard_size: int, sharded: bool) -> int:
    """Bytes of weights rank 0 of a group of ``shard_size`` holds of ``module``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ray_hsdp.memory import module_memory
    from ray_hsdp.sharding import resolve_plan, shard_module

    if not sharded or shard_size == 1:
        return sum(p.numel() * p.element_size() for p in module.parameters())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=shard_size)
    try:
        mesh = init_device_mesh("cpu", (shard_size,))
        plan = resolve_plan(module, 50_000_000)
        shard_module(module, plan, mesh, gather="fsdp2", reshard_after_forward=True, forward_prefetch=1)
        held = module_memory(module)
        return held["sharded_local"] + held["replicated"]
    finally:
        dist.destroy_process_group()


def measure(arch: str, shard_sizes: list[int]) -> dict:
    from ray_hsdp.config.group import DEFAULT_SHARD_COMPONENTS

    rows = {}
    for name, build in large_parts(arch).items():
        sharded = name in DEFAULT_SHARD_COMPONENTS
        rows[name] = {"sharded": sharded, "bytes": {s: rank_bytes(on_meta(build), s, sharded) for s in shard_sizes}}
    for name, size in whole_bytes(arch).items():
        rows[name] = {"sharded": False, "bytes": dict.fromkeys(shard_sizes, size)}
    totals = {s: sum(r["bytes"][s] for r in rows.values()) for s in shard_sizes}
    return {"arch": arch, "components": rows, "per_gpu": totals}


def markdown(results: list[dict], shard_sizes: list[int], command: str) -> str:
    head = " | ".join(f"S={s} GiB per GPU" for s in shard_sizes)
    lines = [
        "# Weights per GPU, real-size architectures (bf16), computed by sharding on the meta device",
        "",
        f"Command: `{command}`",
        "",
        "Rank 0's weights after the ranks' own sharding code and policies (torch's fake process group of S ranks);",
        "VAEs whole (bf16, as the group loads them). Not a GPU measurement: a forward adds its gathered units,",
        "activations and decode.",
        "",
        f"| model | component | sharded | {head} |",
        "| --- | --- | --- | " + " | ".join("---" for _ in shard_sizes) + " |",
    ]
    for result in results:
        for name, row in result["components"].items():
            cells = " | ".join(f"{row['bytes'][s] / GIB:.2f}" for s in shard_sizes)
            lines.append(f"| {result['arch']} | {name} | {'yes' if row['sharded'] else 'no'} | {cells} |")
        cells = " | ".join(f"**{result['per_gpu'][s] / GIB:.2f}**" for s in shard_sizes)
        lines.append(f"| {result['arch']} | **all** | | {cells} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", nargs="+", required=True)
    parser.add_argument("--shard-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="weights-per-gpu")
    args = parser.parse_args()
    results = [measure(arch, args.shard_sizes) for arch in args.archs]
    command = "python -m bench.weights " + " ".join(sys.argv[1:])
    payload = {"environment": environment(), "command": command, "results": results}
    write_results(args.out, args.name, payload, markdown(results, args.shard_sizes, command))
    print(markdown(results, args.shard_sizes, command))


if __name__ == "__main__":
    main()
