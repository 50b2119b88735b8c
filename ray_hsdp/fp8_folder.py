"""FP8 folders: a diffusers folder whose denoisers keep their units' linears in FP8, each with its
float32 scale per output row (``ray-hsdp quantize``, ``checkpoints.quantize``). A rank loads them as
they are, without quantizing at its start; its results equal quantizing at the start with the same
configuration.

The folder says, in ``RECORD`` at its root, what decided its FP8 weights: which linears (per
component, from the sharding policy's plan under ``min_num_params``), the adapters merged before
quantizing (``fuse_loras``), the dtype and the torch version. A configuration that would have made
other weights is refused with what differs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

#: The record's file name, at the folder's root.
RECORD = "ray_hsdp_fp8.json"


def read_record(folder: Path) -> dict | None:
    """The folder's record, or ``None`` for a folder ``ray-hsdp quantize`` did not write."""
    path = Path(folder) / RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def torch_release(version: str) -> str:
    """``major.minor`` of a torch version: what the record's torch is compared by (a patch release
    quantizes the same)."""
    return ".".join(version.split("+")[0].split(".")[:2])


def stored_fp8_components(
    folder: Path,
    quantization: str,
    dtype: str,
    min_num_params: int,
    fuse_loras: Mapping[str, float],
    torch_version: str | None,
    shard_components: tuple[str, ...],
) -> frozenset[str]:
    """The components whose FP8 linears ``folder`` stores, checked against the configuration that
    loads it; empty for a folder without a record. ``torch_version`` ``None``: not compared
    (``ray-hsdp check`` runs on a host whose torch need not be the ranks').

    Raises:
        ValueError: The configuration differs from the one the folder was written with (the
            message names the field, both values and the fix).
    """
    record = read_record(folder)
    if record is None:
        return frozenset()
    where = f"{folder} holds FP8 weights written by `ray-hsdp quantize`"
    if quantization != "fp8":
        raise ValueError(f"{where}: serve it with quantization: fp8, or serve the folder it was made from")
    wanted = {
        "dtype": dtype,
        "min_num_params": min_num_params,
        "fuse_loras": {name: float(scale) for name, scale in sorted(fuse_loras.items())},
    }
    if torch_version is not None:
        wanted["torch"] = torch_release(torch_version)
    written = {**record, "torch": torch_release(record["torch"])}
    for field, value in wanted.items():
        if written[field] != value:
            raise ValueError(
                f"{where} with {field}={written[field]!r}; this configuration has {field}={value!r}: "
                f"quantize again with it (ray-hsdp quantize), or serve with {field}={written[field]!r}"
            )
    outside = sorted(set(record["components"]) - set(shard_components))
    if outside:
        raise ValueError(f"{where} for {outside}, which shard_components={list(shard_components)} leaves out")
    return frozenset(record["components"])


def check_stored_linears(folder: Path, component: str, names: list[str]) -> None:
    """Raises ``ValueError`` unless the linears the policy makes FP8 now (``names``) are those the
    folder stores in FP8 for ``component``."""
    stored = read_record(folder)["components"][component]
    if sorted(stored) != sorted(names):
        extra, gone = sorted(set(names) - set(stored)), sorted(set(stored) - set(names))
        raise ValueError(
            f"{folder}: the sharding policy makes other linears of {component} FP8 than the folder stores "
            f"(not stored: {extra[:5]}; stored, not wanted: {gone[:5]}): quantize again with this version"
        )
