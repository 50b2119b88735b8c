"""The embedded default model: a tiny, seeded Wan text-to-video diffusers folder.

It is the Wan2.1 (or, with two experts, Wan2.2) architecture of ``make-random`` at its tiny size:
a normal diffusers folder (``model_index.json``, safetensors, a tokenizer), loaded through
exactly the same code as a real checkpoint, because our test machines cannot reach a model hub.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_SEED = 0


def make_tiny(
    directory: str | Path,
    two_experts: bool = False,
    overwrite: bool = False,
    image_to_video: bool = False,
    arch: str | None = None,
) -> Path:
    """Writes the tiny Wan pipeline as a diffusers folder.

    Args:
        directory: Target folder; created if missing.
        two_experts: Write a two-expert (Wan2.2-style) pipeline; its boundary sits at half of the
            noise schedule, so that short and long requests soon sit at different experts.
        overwrite: Replace an existing pipeline in ``directory``.
        image_to_video: Write the image-to-video pipeline (``WanImageToVideoPipeline``): Wan2.1-I2V
            with its CLIP vision encoder, or with ``two_experts`` Wan2.2-I2V-A14B (no image encoder).
        arch: Write this architecture's tiny variant instead (``ray-hsdp make-random --tiny``), e.g.
            ``qwen-image``; the Wan choices above do not apply to it.

    Returns:
        The folder, which ``DiffusionPipeline.from_pretrained`` loads.

    Raises:
        FileExistsError: The folder already holds a pipeline and ``overwrite`` is False.
    """
    from ray_hsdp.checkpoints.random_weights import make_random

    path = Path(directory)
    if (path / "model_index.json").exists() and not overwrite:
        raise FileExistsError(f"{path} already holds a diffusers pipeline (pass overwrite=True to replace it)")
    task = "i2v" if image_to_video else "t2v"
    settings = {"boundary_ratio": 0.5} if two_experts and arch is None else None
    arch = arch or (f"wan2.2-{task}-a14b" if two_experts else f"wan2.1-{task}-14b")
    make_random(arch, path, tiny=True, dtype="float32", seed=TINY_SEED, pipeline_config=settings)
    return path


def is_pipeline_folder(directory: str | Path) -> bool:
    """True when ``directory`` holds a diffusers ``model_index.json`` that parses."""
    index = Path(directory) / "model_index.json"
    try:
        return isinstance(json.loads(index.read_text()), dict)
    except (OSError, ValueError):
        return False
