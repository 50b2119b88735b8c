"""Responses as media files: H.264 MP4 (PyAV, which brings its own FFmpeg), and PNG, JPEG or WebP
images (Pillow)."""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import numpy as np


def frames_for_seconds(seconds: float, fps: int, temporal_compression: int) -> int:
    """Frames of a clip of ``seconds`` at ``fps``, rounded to the nearest count the VAE takes.

    A video VAE that compresses time ``t`` times takes ``t * k + 1`` frames (Wan: 4k+1 at 16 fps,
    so 5 s is 81 frames).
    """
    k = max(1, round((seconds * fps - 1) / temporal_compression))
    return temporal_compression * k + 1


#: x264's preset: at the same quality (crf 12) "veryfast" encodes 81 frames of 832x480 2.5-3 times as
#: fast as "medium", a little smaller (``bench.encoding --frames 81``, bench/results/encoding-2core.md);
#: the encoding runs after the decode, on the request's critical path.
MP4_PRESET = "veryfast"


def encode_mp4(frames: np.ndarray, fps: int, preset: str = MP4_PRESET) -> bytes:
    """An MP4 of ``frames`` (``(F, H, W, 3)`` uint8): H.264, yuv420p, ``fps``, moov atom first so
    that a browser's ``<video>`` starts playing before the whole file has arrived; x264's ``preset``."""
    import av

    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected (frames, height, width, 3) uint8, got {frames.shape} {frames.dtype}")
    with tempfile.TemporaryDirectory() as tmp:
        # A file rather than a buffer: moving the moov atom first rewrites it in a second pass.
        path = Path(tmp) / "video.mp4"
        with av.open(str(path), mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
            stream = container.add_stream("libx264", rate=fps)
            stream.width, stream.height = frames.shape[2], frames.shape[1]
            stream.pix_fmt = "yuv420p"
            # Near-transparent quality: generated frames are compared against their source.
            stream.options = {"crf": "12", "preset": preset}
            for frame in frames:
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        return path.read_bytes()


def decode_mp4(data: bytes) -> tuple[np.ndarray, float]:
    """The frames (``(F, H, W, 3)`` uint8) and frame rate of an MP4."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])
        return frames, float(stream.average_rate)


#: The images API's ``output_format`` values (OpenAI's), with Pillow's name for each.
IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
#: zlib level of a PNG: level 1 keeps most of the default's (6) compression at a fraction of its
#: time, and the response waits on it.
PNG_COMPRESS_LEVEL = 1
#: Quality of a JPEG or WebP when the request gives no ``output_compression`` (OpenAI's default).
DEFAULT_QUALITY = 100
#: WebP's encoder effort, 0 (fastest) to 6: Pillow's default (4) takes several times as long.
WEBP_METHOD = 0


def to_uint8(frame: np.ndarray) -> np.ndarray:
    """A frame as uint8: uint8 as it is, float in [0, 1] scaled and rounded."""
    if frame.dtype == np.uint8:
        return frame
    return (np.clip(frame, 0.0, 1.0) * 255).round().astype(np.uint8)


def encode_image(frame: np.ndarray, output_format: str = "png", quality: int | None = None) -> bytes:
    """One ``(H, W, 3)`` frame (uint8, or float in [0, 1]) as an ``output_format`` file.

    Args:
        frame: The image.
        output_format: ``png`` (lossless, at ``PNG_COMPRESS_LEVEL``), ``jpeg`` or ``webp``.
        quality: 0-100 for ``jpeg`` and ``webp`` (``DEFAULT_QUALITY`` when None); a PNG takes none.
    """
    from PIL import Image

    if output_format not in IMAGE_FORMATS:
        raise ValueError(f"output_format must be one of {sorted(IMAGE_FORMATS)}, got {output_format!r}")
    if output_format == "png" and quality is not None:
        raise ValueError("a png is lossless: it takes no quality")
    options: dict = {"compress_level": PNG_COMPRESS_LEVEL}
    if output_format != "png":
        options = {"quality": DEFAULT_QUALITY if quality is None else quality}
    if output_format == "webp":
        options["method"] = WEBP_METHOD
    buffer = io.BytesIO()
    Image.fromarray(to_uint8(frame)).save(buffer, format=IMAGE_FORMATS[output_format], **options)
    return buffer.getvalue()


def encode_png(frame: np.ndarray) -> bytes:
    """PNG of one ``(H, W, 3)`` frame: uint8, or float in [0, 1]."""
    return encode_image(frame, "png")
