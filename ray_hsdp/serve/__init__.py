"""Ray Serve front of ray_hsdp: schema, deployment, app builders.

Layer: Below the command line: may import group and every package below it; not cli.
"""

from ray_hsdp.serve.app import build_app, build_endpoint, build_model

__all__ = ["build_app", "build_endpoint", "build_model"]
