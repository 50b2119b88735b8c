"""The one rule for which rows of a dim-0 shard a rank holds, as torch's ``Shard(0)`` (and FSDP2)
splits them: chunks of ``ceil(rows / world)``, the last ranks' shorter or empty. The loader, the
in-place gathers and FP8's row scales all ask it."""

from __future__ import annotations

import math


def rows_per_rank(rows: int, world: int) -> int:
    """Rows of each rank's chunk (the last ranks hold fewer; a gather pads them to this)."""
    return math.ceil(rows / world)


def rows_of(rows: int, world: int, index: int) -> slice:
    """The rows rank ``index`` of ``world`` holds of a tensor with ``rows`` rows."""
    per_rank = rows_per_rank(rows, world)
    first = min(index * per_rank, rows)
    return slice(first, min(first + per_rank, rows))
