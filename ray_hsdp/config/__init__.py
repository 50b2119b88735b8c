"""The typed configuration (``GroupConfig``, ``AppConfig`` and their blocks), the parallel layout it
derives, the pairs of options refused together, and the embedded tiny models' names. Lowest layer
but the request: may import ``ray_hsdp.request`` only; every other package imports it."""

from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.group import GroupConfig

__all__ = ["AppConfig", "GroupConfig"]
