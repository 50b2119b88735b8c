"""What every benchmark records beside its numbers: machine, versions, command."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path


def environment() -> dict:
    import diffusers
    import ray
    import torch
    import transformers

    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {
        "gpus": gpus,
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "ray": ray.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "command": " ".join(sys.argv),
    }


def write_results(out_dir: Path, name: str, payload: dict, markdown: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2))
    (out_dir / f"{name}.md").write_text(markdown)
    print(markdown)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"
