"""``ray-hsdp``'s commands that write model folders: the tiny and real-size random checkpoints
(``make-tiny``, ``make-random``), random LoRA files (``make-random-lora``) and FP8 folders
(``quantize``)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ray_hsdp.checkpoints.architectures import ARCHITECTURES
from ray_hsdp.config.group import GroupConfig


def add_writers(sub) -> None:
    """The subcommands of this module."""
    _add_make_tiny(sub)
    _add_make_random(sub)
    _add_make_random_lora(sub)
    _add_quantize(sub)


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from ray_hsdp.checkpoints.tiny import make_tiny

    path = make_tiny(args.directory, two_experts=args.two_experts, overwrite=args.overwrite, image_to_video=args.i2v)
    print(f"Wrote the tiny Wan pipeline to {path}")
    return 0


def cmd_make_random(args: argparse.Namespace) -> int:
    from ray_hsdp.checkpoints.architectures import get_architecture
    from ray_hsdp.checkpoints.random_weights import make_random

    arch = get_architecture(args.arch)
    written = make_random(
        args.arch, args.directory, tiny=args.tiny, dtype=args.dtype, seed=args.seed, small_encoders=args.small_encoders
    )
    size = "tiny variant" if args.tiny else f"real size, {arch.params_billion}B parameters per expert"
    print(f"Wrote {args.arch} ({size}, random weights, seed {args.seed}) to {written['path']}")
    for expert, nbytes in written["transformer_bytes"].items():
        print(f"  {expert}: {nbytes / 2**30:.2f} GiB of {args.dtype} weights")
    for part, nbytes in written["real_parts"].items():
        print(f"  {part}: real size, {nbytes / 2**30:.2f} GiB")
    if written["stand_ins"]:
        print(f"  stand-ins (small, random, NOT the real architecture): {', '.join(written['stand_ins'])}")
    return 0


def cmd_make_random_lora(args: argparse.Namespace) -> int:
    from ray_hsdp.checkpoints.lora import make_random_lora

    written = make_random_lora(
        args.target, args.directory, rank=args.rank, seed=args.seed, tiny=args.tiny, dtype=args.dtype,
        layout=args.layout,
    )  # fmt: skip
    print(
        f"Wrote a random rank-{args.rank} LoRA for {args.target} (seed {args.seed}) to {written['path']}: "
        f"{written['layers']} linear layers, {written['params'] / 1e6:.1f}M parameters, "
        f"{written['bytes'] / 2**20:.1f} MiB of {args.dtype}"
    )
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    """Writes the FP8 folder of a model, with the options of the group that will serve it."""
    from ray_hsdp.cli.quantize import write_fp8_folder
    from ray_hsdp.cli.serve_flags import lora_files
    from ray_hsdp.loading.components import resolve_lora_path, resolve_model_path
    from ray_hsdp.request import parse_lora

    config = GroupConfig(
        model=args.model, device="cpu", dtype=args.dtype, min_num_params=args.min_num_params,
        loras=lora_files(args.lora_file), fuse_loras=dict(parse_lora(args.fuse_lora)),
        **({"shard_components": tuple(args.shard_components.split(","))} if args.shard_components else {}),
    )  # fmt: skip
    fused = {
        name: (config.fuse_loras[name], {part: resolve_lora_path(source) for part, source in parts.items()})
        for name, parts in config.lora_sources(fused=True).items()
    }
    started = time.perf_counter()
    try:
        record = write_fp8_folder(
            resolve_model_path(config.model), Path(args.out), dtype=args.dtype, min_num_params=config.min_num_params,
            shard_components=config.shard_components, fused=fused,
        )  # fmt: skip
    except (FileExistsError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    linears = {name: len(names) for name, names in record["components"].items()}
    print(f"Wrote {args.out} in {time.perf_counter() - started:.0f} s: FP8 linears {linears}; serve it with "
          f"quantization: fp8, dtype: {args.dtype}, min_num_params: {config.min_num_params}"
          + (f", fuse_loras: {record['fuse_loras']}" if record["fuse_loras"] else ""))  # fmt: skip
    return 0


def _add_make_tiny(sub) -> None:
    """The ``make-tiny`` subcommand and its arguments."""
    p = sub.add_parser("make-tiny", help="write the tiny Wan pipeline (seeded random weights) to a folder")
    p.add_argument("directory")
    p.add_argument("--two-experts", action="store_true", help="a Wan2.2-style pipeline with transformer_2")
    p.add_argument("--i2v", action="store_true", help="the image-to-video pipeline (WanImageToVideoPipeline)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_make_tiny)


def _add_make_random(sub) -> None:
    """The ``make-random`` subcommand and its arguments."""
    p = sub.add_parser("make-random", help="write a real-size architecture with seeded random weights")
    p.add_argument("arch", choices=sorted(ARCHITECTURES), help="the architecture to write")
    p.add_argument("directory")
    p.add_argument("--tiny", action="store_true", help="the tiny variant of the architecture (CPU tests)")
    p.add_argument(
        "--small-encoders",
        action="store_true",
        help="small stand-ins for the text encoders and the VAE instead of the real-size ones",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="stored dtype (default: bfloat16, float32 with --tiny)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_random)


def _add_make_random_lora(sub) -> None:
    """The ``make-random-lora`` subcommand and its arguments."""
    p = sub.add_parser("make-random-lora", help="write a LoRA with seeded random weights")
    p.add_argument("target", help="an architecture of make-random (wan2.1-t2v-14b, ...) or a pipeline folder")
    p.add_argument("directory")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--tiny", action="store_true", help="for the tiny variant of the architecture")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--layout", default="diffusers", help="the file's keys: diffusers, wan (lightx2v's Wan LoRAs) or lightning"
    )
    p.set_defaults(func=cmd_make_random_lora)


def _add_quantize(sub) -> None:
    """The ``quantize`` subcommand: an FP8 folder (``ray_hsdp.loading.fp8_folder``)."""
    p = sub.add_parser(
        "quantize", help="write a copy of a model whose transformers' linears are stored in FP8 (quantization: fp8)"
    )
    p.add_argument("model", help="a diffusers folder (or an embedded model's name)")
    p.add_argument("out", help="the folder to write (must not exist)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="the dtype the group serves the model in")  # fmt: skip
    p.add_argument("--min-num-params", type=int, default=GroupConfig.model_fields["min_num_params"].default,
                   help="the sharding policy's size rule, as the serving group's")  # fmt: skip
    p.add_argument("--shard-components", default=None, metavar="NAME,...",
                   help="components that may be quantized (default: the group's default shard_components)")  # fmt: skip
    p.add_argument("--lora-file", action="append", default=[], metavar="NAME[.COMPONENT]=PATH",
                   help="register a LoRA adapter (repeatable): those of --fuse-lora are merged first")  # fmt: skip
    p.add_argument("--fuse-lora", default=None, metavar="NAME[:SCALE],...",
                   help="adapters merged before quantizing: serve with the same fuse_loras")  # fmt: skip
    p.set_defaults(func=cmd_quantize)
