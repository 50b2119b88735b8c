"""The ``ray_hsdp`` logger in a Serve replica's process."""

from __future__ import annotations

import logging


def show_logs() -> None:
    """Sends the ``ray_hsdp`` logger's INFO lines (the request log) to this process's stderr.

    Serve configures only its own ``ray.serve`` logger in a replica; without this, the one JSON
    line per request and the group's lifecycle lines would be dropped at the root logger's WARNING.
    """
    ours = logging.getLogger("ray_hsdp")
    if not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False
