"""What a response's encoding costs: each images-API ``output_format`` (``ray_hsdp.serve.media``'s
own encoder, as a replica runs it) and PIL's default PNG level, at a size, on this machine's CPU;
with ``--frames N``, a video job's MP4 of N frames at x264's served preset and at "medium".

    python -m bench.encoding --size 1328x1328 --out bench/results/encoding-2core.md
    python -m bench.encoding --size 832x480 --frames 81 --repeat 2

The frame is a generated image's stand-in: smooth colour fields with Gaussian noise (sigma 0.03), in
[0, 1] float32 as a group returns it; the time includes the conversion to uint8. Best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import time

import numpy as np

from ray_hsdp.serve.media import MP4_PRESET, encode_image, encode_mp4, to_uint8


def stand_in_frame(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A ``(H, W, 3)`` float32 frame in [0, 1]: smooth fields plus noise."""
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    fields = np.stack([np.sin(6 * x) * 0.5 + 0.5, np.cos(5 * y) * 0.5 + 0.5, x * y], -1)
    noise = np.random.default_rng(seed).normal(0, 0.03, fields.shape)
    return np.clip(fields + noise, 0, 1).astype(np.float32)


def best_of(repeat: int, encode) -> tuple[float, int]:
    """The fastest of ``repeat`` runs of ``encode()`` (seconds) and the bytes it made."""
    best, size = float("inf"), 0
    for _ in range(repeat):
        start = time.perf_counter()
        data = encode()
        best = min(best, time.perf_counter() - start)
        size = len(data)
    return best, size


def pil_default_png(frame: np.ndarray) -> bytes:
    """PNG at PIL's default zlib level (6): what the images API wrote before ``PNG_COMPRESS_LEVEL``."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(to_uint8(frame)).save(buffer, format="PNG")
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1328x1328", help="WxH of the frame")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--frames", type=int, default=None, help="an MP4 of this many frames instead of images")
    parser.add_argument("--out", help="a Markdown file to write the table to")
    args = parser.parse_args()
    width, height = map(int, args.size.split("x"))
    frame = stand_in_frame(width, height)
    if args.frames:
        cases, what = video_cases(width, height, args.frames), f"an MP4 of {args.frames} frames of {width}x{height}"
    else:
        cases, what = image_cases(frame), f"one {width}x{height} image"
    cpu = platform.processor() or platform.machine()
    rows = [
        f"Encoding {what}, best of {args.repeat}, on {cpu} ({os.cpu_count()} CPUs)",
        "",
        "| output | ms | MB |",
        "| --- | ---: | ---: |",
    ]
    for name, encode in cases:
        seconds, size = best_of(args.repeat, encode)
        rows.append(f"| {name} | {seconds * 1e3:.0f} | {size / 1e6:.2f} |")
    text = "\n".join(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")


def video_cases(width: int, height: int, frames: int) -> list:
    """The served preset and "medium" on a moving stand-in clip (each frame its own noise, the
    fields shifting), and on pure noise: the worst case for x264, and what random weights make."""
    clip = np.stack([to_uint8(np.roll(stand_in_frame(width, height, seed=i), 4 * i, axis=1)) for i in range(frames)])
    noise = np.random.default_rng(0).integers(0, 256, clip.shape, dtype=np.uint8)
    return [
        (
            f"{name}, x264 {preset}{' (served)' if preset == MP4_PRESET else ''}",
            lambda v=video, p=preset: encode_mp4(v, 16, p),
        )
        for name, video in (("moving stand-in", clip), ("noise", noise))
        for preset in (MP4_PRESET, "medium")
    ]


def image_cases(frame: np.ndarray) -> list:
    return [
        ("png, PIL's default level (before)", lambda: pil_default_png(frame)),
        ("png (the default)", lambda: encode_image(frame, "png")),
        ("jpeg, output_compression omitted (100)", lambda: encode_image(frame, "jpeg")),
        ("jpeg, output_compression 90", lambda: encode_image(frame, "jpeg", 90)),
        ("webp, output_compression omitted (100)", lambda: encode_image(frame, "webp")),
        ("webp, output_compression 80", lambda: encode_image(frame, "webp", 80)),
    ]


if __name__ == "__main__":
    main()
