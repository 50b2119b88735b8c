"""The command line (``ray-hsdp``): its commands, the serve flags generated from the config, ``check``,
the kernels' build and the FP8 folder's writer (``quantize``). Top layer: may import every package
below it (serve, group, loading, config, ...); nothing imports it."""

from ray_hsdp.cli.commands import main, memory_table

__all__ = ["main", "memory_table"]
