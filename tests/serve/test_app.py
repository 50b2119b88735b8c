"""``ray_hsdp.serve.app``: what building an application costs its process."""

from __future__ import annotations

import subprocess
import sys


def test_the_app_builder_and_the_serve_replicas_import_no_torch():
    """The app builder, the ingress and the group replicas route; only ranks import torch (seconds
    of a process's start, and its memory). The warm-up check imports it only when it runs."""
    code = (
        "import sys; import ray_hsdp.serve.app, ray_hsdp.serve.replica.server, ray_hsdp.serve.ingress.server; "
        "print(sorted(m for m in ('torch', 'diffusers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
