"""Ray Serve front of ray_hsdp: schema, deployment, app builder."""

from ray_hsdp.serve.app import build_app

__all__ = ["build_app"]
