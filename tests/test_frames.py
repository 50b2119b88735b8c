"""The frames' way to the host (``ray_hsdp.pipeline.frames``) gives the values of diffusers' ``"np"``
output, and of the uint8 cast the project did on the host before."""

import numpy as np
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.video_processor import VideoProcessor

from ray_hsdp.pipeline.frames import to_host


def decoded(shape: tuple[int, ...]) -> torch.Tensor:
    """What a VAE decodes to: bf16 around [-1, 1], some values outside it, some exactly on a
    uint8 rounding boundary after denormalization (x.5 / 255)."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.7
    values.view(-1)[:64] = torch.arange(64) * (2.0 / 255) - 1.0 + 1.0 / 255
    return values.to(torch.bfloat16)


def host_uint8(frames: np.ndarray) -> np.ndarray:
    return (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)


def test_video_frames_equal_diffusers_np_output_and_its_uint8_cast():
    video = decoded((1, 3, 5, 16, 24))  # (batch, channels, frames, height, width), as Wan's VAE
    processor = VideoProcessor(vae_scale_factor=8)
    expected = processor.postprocess_video(video, output_type="np")  # (1, 5, 16, 24, 3) float32
    pt = processor.postprocess_video(video, output_type="pt")  # (1, 5, 3, 16, 24), what the pipeline returns
    floats = to_host(pt, uint8=False)
    assert floats.frames.dtype == np.float32 and floats.non_finite == 0
    np.testing.assert_array_equal(floats.frames, expected)
    ints = to_host(pt, uint8=True)
    assert ints.frames.dtype == np.uint8 and ints.frames.flags["C_CONTIGUOUS"]  # as an encoder reads it
    np.testing.assert_array_equal(ints.frames, host_uint8(expected))
    np.testing.assert_array_equal(to_host(expected, uint8=True).frames, host_uint8(expected))  # an "np" pipeline


def test_images_become_videos_of_one_frame():
    images = decoded((2, 3, 16, 24))
    processor = VaeImageProcessor(vae_scale_factor=8)
    expected = processor.postprocess(images, output_type="np")  # (2, 16, 24, 3)
    host = to_host(processor.postprocess(images, output_type="pt"), uint8=False)
    assert host.frames.shape == (2, 1, 16, 24, 3)
    np.testing.assert_array_equal(host.frames[:, 0], expected)


@pytest.mark.parametrize("uint8", [False, True])
def test_values_that_are_not_finite_are_counted_before_the_cast(uint8):
    frames = torch.rand(1, 3, 3, 4, 4)
    frames[0, 1, 0, 0, 0] = float("nan")
    frames[0, 2, 1, 0, 0] = float("inf")
    assert to_host(frames, uint8).non_finite == 2
    assert to_host(frames.movedim(2, -1).numpy(), uint8).non_finite == 2
