"""FP8 folders: a diffusers folder whose denoisers keep their units' linears in FP8, each with its
float32 scale per output row (``ray-hsdp quantize``, ``cli.quantize``). A rank loads them as
they are, without quantizing at its start; its results equal quantizing at the start with the same
configuration.

The folder says, in ``RECORD`` at its root, what decided its FP8 weights: which linears (per
component, from the sharding policy's plan under ``min_num_params``), the adapters merged before
quantizing (``fuse_loras``) and each one's file digest, the dtype and the torch version. A
configuration that would have made other weights (another file under an adapter's name included)
is refused with what differs.
"""

from __future__ import annotations

import hashlib
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


def adapter_digest(path: Path) -> str:
    """SHA-256 of an adapter's file, or of a folder's files (each one's name and bytes, by name)."""
    path = Path(path)
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    for file in files:
        if file != path:
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with file.open("rb") as stream:
            for chunk in iter(lambda: stream.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()


def adapter_digests(files: Mapping[str, Mapping[str, Path]]) -> dict[str, dict[str, str]]:
    """Adapter -> component -> ``adapter_digest`` of its file."""
    return {name: {c: adapter_digest(p) for c, p in sorted(parts.items())} for name, parts in sorted(files.items())}


def stored_fp8_components(
    folder: Path,
    quantization: str,
    dtype: str,
    min_num_params: int,
    fuse_loras: Mapping[str, float],
    torch_version: str | None,
    shard_components: tuple[str, ...],
    fused_files: Mapping[str, Mapping[str, Path]] | None = None,
) -> frozenset[str]:
    """The components whose FP8 linears ``folder`` stores, checked against the configuration that
    loads it; empty for a folder without a record. ``torch_version`` ``None``: not compared
    (``ray-hsdp check`` runs on a host whose torch need not be the ranks'). ``fused_files``: the
    files of ``fuse_loras`` (adapter -> component -> path), each compared with the digest of the
    file the folder fused (``None``: not compared).

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
    kept = record.get("fuse_lora_files", {})
    for name, parts in (fused_files or {}).items():
        for component, path in parts.items():
            if kept.get(name, {}).get(component) != adapter_digest(path):
                raise ValueError(
                    f"{where} with adapter {name!r} ({component}) fused from another file than {path}: quantize "
                    "again with this file (ray-hsdp quantize), or serve the file the folder was made with"
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
