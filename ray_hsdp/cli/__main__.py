"""``python -m ray_hsdp.cli``: the ``ray-hsdp`` command."""

from ray_hsdp.cli.commands import main

raise SystemExit(main())
