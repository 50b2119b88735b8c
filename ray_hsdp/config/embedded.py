"""The embedded tiny models and adapters: the names a config's ``model`` and ``loras`` may give them,
and where a node writes them on first use (``loading.resolve_model_path``)."""

from __future__ import annotations

import os
from pathlib import Path

#: The model name that stands for the embedded tiny Wan pipeline (written on first use).
TINY_MODEL = "tiny"
#: The embedded tiny pipelines, written on first use: model name -> the name clients use (and the
#: folder under ``cache_dir()``: ``embedded_folder``). ``tiny-i2v`` is the image-to-video Wan2.1 one;
#: the others are the tiny variants of ``make-random``'s architectures of those names.
EMBEDDED_MODELS = {
    TINY_MODEL: "tiny-wan",
    "tiny-i2v": "tiny-wan-i2v",
    "tiny-qwen-image": "tiny-qwen-image",
    "tiny-wan2.2-ti2v": "tiny-wan2.2-ti2v",
    "tiny-flux2": "tiny-flux2",
    "tiny-hunyuanvideo-1.5": "tiny-hunyuanvideo-1.5",
}
#: The embedded tiny model's LoRA adapters, written on first use (random, seeded): name -> seed.
EMBEDDED_LORAS = {"tiny-style": 1, "tiny-detail": 2}

#: Part of the embedded models' cache folder names. An embedded model is written only when its
#: folder is missing, so a writer that makes different weights must bump it, or caches written
#: earlier keep serving the old ones (2: a VAE whose images vary, not flat gray).
EMBEDDED_VERSION = 2


def cache_dir() -> Path:
    """Folder for files ray_hsdp writes for itself (the embedded tiny model); ``RAY_HSDP_HOME`` moves it."""
    return Path(os.environ.get("RAY_HSDP_HOME", Path.home() / ".cache" / "ray_hsdp"))


def embedded_folder(model: str) -> Path:
    """Where the embedded model ``model`` (a key of ``EMBEDDED_MODELS``) is written on this node."""
    return cache_dir() / f"{EMBEDDED_MODELS[model]}-v{EMBEDDED_VERSION}"
