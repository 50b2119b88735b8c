"""Finding and loading a diffusers pipeline folder on a rank."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import torch
from filelock import FileLock

from ray_hsdp.config import TINY_MODEL, cache_dir
from ray_hsdp.checkpoints.tiny import is_pipeline_folder, make_tiny

logger = logging.getLogger("ray_hsdp")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tiny_model_dir() -> Path:
    """Where the embedded tiny pipeline lives on this node."""
    return cache_dir() / "tiny-wan"


def resolve_model_path(model: str) -> Path:
    """Turns a config's ``model`` into a pipeline folder on this node.

    ``"tiny"`` is written on first use. The writer is seeded, so every node that writes it gets the
    same weights; a file lock keeps ranks of one node from writing it at once, and the folder
    appears only when complete (written aside, then renamed), so a killed writer leaves no half.
    Call it before the process group exists: transformers writes weights only on distributed rank 0.

    Raises:
        FileNotFoundError: ``model`` is not a diffusers pipeline folder.
    """
    if model == TINY_MODEL:
        path = tiny_model_dir()
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock"):
            if not is_pipeline_folder(path):
                logger.info("Writing the embedded tiny Wan pipeline to %s", path)
                staging = Path(tempfile.mkdtemp(prefix=".tiny-wan-", dir=path.parent))
                make_tiny(staging, overwrite=True)
                shutil.rmtree(path, ignore_errors=True)
                staging.rename(path)
        return path
    path = Path(model).expanduser()
    if not is_pipeline_folder(path):
        raise FileNotFoundError(
            f"{model!r} is not a diffusers pipeline folder (no readable model_index.json); "
            f"give a local folder or {TINY_MODEL!r}"
        )
    return path


def load_pipeline(path: Path, dtype: str, allow_pickle: bool = False):
    """Loads the pipeline on the CPU with the plain diffusers loader.

    Args:
        path: A pipeline folder (see ``resolve_model_path``).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        allow_pickle: Permit pickle ``.bin`` weights; only safetensors otherwise.
    """
    from diffusers import DiffusionPipeline
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    # Ranks log to Ray's console; progress bars of every rank would drown the log lines we want.
    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    return DiffusionPipeline.from_pretrained(path, dtype=DTYPES[dtype], use_safetensors=None if allow_pickle else True)
