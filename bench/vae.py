"""The VAE decode alone, per memory format and cuDNN setting: where a short (4-step) request's time
after its loop goes.

    python -m bench.vae --model-dir /tmp/wan14b --sizes 832x480 1280x720 --frames 81

One seeded latent per size, decoded by the pipeline's VAE as the pipeline loads it (bf16 on CUDA;
without ``--model-dir``, the architecture's real-size VAE built in memory with its initial weights),
untiled and tiled, for each variant: ``default``; ``benchmark`` (``torch.backends.cudnn.benchmark``:
cuDNN times its algorithms per shape once and keeps the fastest); ``channels_last_3d`` (the
Conv3d weights in NDHWC, ``torch.nn.utils.convert_conv3d_weight_memory_format``, so that cuDNN may
run its channels-last kernels without transposing); and both; ``compile`` (the decoder
``torch.compile``d: its norms, activations and cache copies fused between the convolutions). A
variant changes no arithmetic but the kernels' order and fusion, so its frames differ from
``default``'s by rounding only (the last column). Each time is the mean of ``--repeats`` decodes
after one warm-up decode.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import ensure_model, environment, write_results

VARIANTS = (
    "default", "benchmark", "channels_last_3d", "channels_last_3d+benchmark", "compile", "channels_last_3d+compile",
)  # fmt: skip
#: id(vae) -> (its eager decoder, the same decoder compiled): a variant swaps them, compiling once.
DECODERS: dict[int, tuple] = {}


def set_variant(vae, variant: str) -> None:
    """Puts the process's cuDNN setting and ``vae``'s Conv3d weights in ``variant``'s state; with
    ``compile``, the decoder ``torch.compile``d (once: the Wan decoder runs frame by frame with its
    causal caches, one graph per kind of frame position and cache shape; on CPU the warm-up decode
    builds all of them, but on an H200 at 720p the decoder compiled without channels-last still
    took 31 s a decode after it, unexplained: ``bench/results/performance-history.md``)."""
    import torch

    torch.backends.cudnn.benchmark = "benchmark" in variant
    fmt = torch.channels_last_3d if "channels_last_3d" in variant else torch.contiguous_format
    torch.nn.utils.convert_conv3d_weight_memory_format(vae, fmt)
    if id(vae) not in DECODERS:
        DECODERS[id(vae)] = (vae.decoder, torch.compile(vae.decoder))
    eager, compiled = DECODERS[id(vae)]
    vae.decoder = compiled if "compile" in variant else eager


def decode_s(vae, latents, tiled: bool, repeats: int, device: str):
    """Mean seconds of ``repeats`` decodes after one warm-up (the compile's, with ``compile``), the
    warm-up's seconds, and the last decode's frames."""
    import torch

    vae.enable_tiling() if tiled else vae.disable_tiling()

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():
        start = time.perf_counter()
        frames = vae.decode(latents, return_dict=False)[0]
        sync()
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(repeats):
            frames = vae.decode(latents, return_dict=False)[0]
        sync()
    return (time.perf_counter() - start) / repeats, first_s, frames.float()


def load_vae(arch: str, model_dir: Path | None, device: str, dtype):
    """The pipeline folder's VAE (written by ``make-random`` unless there), or without a folder the
    architecture's real-size VAE built in memory: the same shapes and kernels, no checkpoint to write."""
    from diffusers import AutoencoderKL, AutoencoderKLWan

    from ray_hsdp.checkpoints.architectures import get_architecture
    from ray_hsdp.checkpoints.real_parts import REAL_PARTS

    if model_dir is None:
        architecture = get_architecture(arch)
        whole, _ = REAL_PARTS[architecture.family](architecture.transformer)
        return whole["vae"].to(device, dtype)
    ensure_model(arch, model_dir, device)
    cls = AutoencoderKLWan if "wan" in arch else AutoencoderKL
    return cls.from_pretrained(model_dir / "vae", torch_dtype=dtype).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="wan2.1-t2v-14b")
    parser.add_argument("--model-dir", type=Path, default=None, help="a pipeline folder (else built in memory)")
    parser.add_argument("--sizes", nargs="+", default=["832x480", "1280x720"])
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiling", choices=("off", "on", "both"), default="both")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="vae-decode")
    args = parser.parse_args()

    import torch

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    vae = load_vae(args.arch, args.model_dir, args.device, dtype).eval()
    rows = []
    for size in args.sizes:
        width, height = (int(v) for v in size.split("x"))
        shape = (1, vae.config.z_dim, (args.frames - 1) // 4 + 1, height // 8, width // 8)
        generator = torch.Generator("cpu").manual_seed(0)
        latents = torch.randn(shape, generator=generator).to(args.device, dtype)
        for tiled in {"off": (False,), "on": (True,), "both": (False, True)}[args.tiling]:
            reference = None
            for variant in args.variants:
                set_variant(vae, variant)
                seconds, first_s, frames = decode_s(vae, latents, tiled, args.repeats, args.device)
                if reference is None:
                    reference = frames
                diff = float((frames - reference).abs().max())
                rows.append({"size": size, "tiled": tiled, "variant": variant, "decode_s": round(seconds, 3),
                             "first_decode_s": round(first_s, 3), "max_abs_diff_to_first": diff})  # fmt: skip
                print(rows[-1], flush=True)
                del frames
        set_variant(vae, "default")
    payload = {"rows": rows, "frames": args.frames, "repeats": args.repeats, "environment": environment()}
    write_results(args.out, args.name, payload, markdown(rows, args))


def markdown(rows: list[dict], args) -> str:
    env = environment()
    lines = [
        f"# VAE decode alone: {args.arch}, {args.frames} frames",
        "",
        f"GPUs: {', '.join(env['gpus']) or 'none (CPU dry run)'}; torch {env['torch']}, diffusers {env['diffusers']}.",
        f"Command: `{env['command']}`",
        "",
        "| size | tiled | variant | decode s | first decode s | vs the first variant | max abs diff to the first |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    first: dict = {}
    for row in rows:
        key = (row["size"], row["tiled"])
        first.setdefault(key, row["decode_s"])
        ratio = first[key] / row["decode_s"] if row["decode_s"] else float("nan")
        lines.append(
            f"| {row['size']} | {row['tiled']} | {row['variant']} | {row['decode_s']:.3f} "
            f"| {row.get('first_decode_s', float('nan')):.2f} | {ratio:.2f}x "
            f"| {row['max_abs_diff_to_first']:.2e} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
