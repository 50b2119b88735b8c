"""Responses as media files: H.264 MP4 (PyAV, which brings its own FFmpeg) and PNG."""

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


def encode_mp4(frames: np.ndarray, fps: int) -> bytes:
    """An MP4 of ``frames`` (``(F, H, W, 3)`` uint8): H.264, yuv420p, ``fps``, moov atom first so
    that a browser's ``<video>`` starts playing before the whole file has arrived."""
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
            stream.options = {"crf": "12", "preset": "medium"}
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


def encode_png(frame: np.ndarray) -> bytes:
    """PNG of one ``(H, W, 3)`` frame: uint8, or float in [0, 1]."""
    from PIL import Image

    if frame.dtype != np.uint8:
        frame = (np.clip(frame, 0.0, 1.0) * 255).round().astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return buffer.getvalue()
