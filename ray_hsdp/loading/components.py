"""Finding a pipeline folder and loading its components, sharded ones slice by slice.

A sharded component is built on the meta device, sharded, materialised empty on the rank's
device, and filled from the safetensors files with only this rank's slices: a rank never holds the
full component in host memory. Every checkpoint key must land in a tensor and every tensor must be
filled, else the load fails naming the keys.
"""

from __future__ import annotations

import ctypes
import importlib
import inspect
import json
import logging
import re
import shutil
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn as nn
from filelock import FileLock
from torch.distributed.tensor import DTensor, Replicate, Shard

from ray_hsdp.checkpoints.tiny import is_pipeline_folder, make_tiny
from ray_hsdp.config.embedded import EMBEDDED_LORAS, EMBEDDED_MODELS, TINY_MODEL, cache_dir, embedded_folder
from ray_hsdp.loading.staged_reads import StagedReads, ThreadStagings
from ray_hsdp.sharding.layout import rows_of

logger = logging.getLogger("ray_hsdp")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


#: Slices a rank reads at once: a file read and a host-to-device copy release the GIL, so a few
#: threads overlap the disk (or the page cache) with the copies, and keep a fast disk's queue full.
READ_THREADS = 8


class CheckpointError(ValueError):
    """A checkpoint does not match the model it should fill (missing, unexpected or misshapen keys)."""


#: How each embedded model is written (``make_tiny``'s arguments).
EMBEDDED_WRITERS = {
    TINY_MODEL: {},
    "tiny-i2v": {"image_to_video": True},
    "tiny-qwen-image": {"arch": "qwen-image"},
    "tiny-wan2.2-ti2v": {"arch": "wan2.2-ti2v-5b"},
    "tiny-flux2": {"arch": "flux.2-dev"},
    "tiny-hunyuanvideo-1.5": {"arch": "hunyuanvideo-1.5"},
}


def resolve_model_path(model: str) -> Path:
    """Turns a config's ``model`` into a pipeline folder on this node.

    An embedded model (``"tiny"``, ``"tiny-i2v"``) is written on first use. The writer is seeded, so
    every node that writes it gets the same weights; a file lock keeps ranks of one node from
    writing it at once, and the folder appears only when complete (written aside, then renamed),
    so a killed writer leaves no half.
    Call it before the process group exists: transformers writes weights only on distributed rank 0.

    Raises:
        FileNotFoundError: ``model`` is not a diffusers pipeline folder.
    """
    if model in EMBEDDED_MODELS:
        path = embedded_folder(model)
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock"):
            if not is_pipeline_folder(path):
                logger.info("Writing the embedded %s pipeline to %s", model, path)
                staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
                make_tiny(staging, overwrite=True, **EMBEDDED_WRITERS[model])
                shutil.rmtree(path, ignore_errors=True)
                staging.rename(path)
        return path
    path = Path(model).expanduser()
    if not is_pipeline_folder(path):
        raise FileNotFoundError(
            f"{model!r} is not a diffusers pipeline folder (no readable model_index.json); "
            f"give a local folder or one of {', '.join(EMBEDDED_MODELS)}"
        )
    return path


def resolve_lora_path(source: str) -> Path:
    """Turns a ``loras`` source into a LoRA file or folder on this node; an embedded adapter
    (``tiny-style``, ``tiny-detail``: random, seeded, for the embedded tiny model) is written on
    first use, as the embedded models are.

    Raises:
        FileNotFoundError: The path does not exist.
    """
    from ray_hsdp.checkpoints.lora import LORA_FILE, make_random_lora

    if source in EMBEDDED_LORAS:
        path = cache_dir() / "loras" / source
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock"):
            if not (path / LORA_FILE).exists():
                staging = Path(tempfile.mkdtemp(prefix=f".{source}-", dir=path.parent))
                model = resolve_model_path(TINY_MODEL)
                make_random_lora(model, staging, rank=4, seed=EMBEDDED_LORAS[source], dtype="float32", strength=1.0)
                shutil.rmtree(path, ignore_errors=True)
                staging.rename(path)
        return path
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"LoRA {source!r} is neither a file or folder on this node nor one of {list(EMBEDDED_LORAS)}"
        )
    return path


def _quiet_progress_bars() -> None:
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    # Ranks log to Ray's console; progress bars of every rank would drown the lines we want.
    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def load_pipeline(path: Path, dtype: str, allow_pickle: bool = False, pipeline_cls: type | None = None, **prebuilt):
    """Loads a pipeline folder on the CPU; components in ``prebuilt`` are used as given.

    Without ``prebuilt`` this is exactly ``from_pretrained`` of ``pipeline_cls`` (``None``: the
    class the folder names, as ``DiffusionPipeline.from_pretrained`` picks it). With it, the
    pipeline is assembled component by component, because diffusers loads an optional component
    (Wan's ``transformer``) from disk even when one is passed in, and a sharded component must
    never be loaded whole.

    Args:
        path: A pipeline folder (see ``resolve_model_path``).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        allow_pickle: Permit pickle ``.bin`` weights; only safetensors otherwise.
        pipeline_cls: The pipeline class to load the folder as (``pipeline_class``).
        **prebuilt: Components already built (the sharded ones).
    """
    _quiet_progress_bars()
    path = Path(path)
    use_safetensors = None if allow_pickle else True
    pipeline_cls = pipeline_cls or pipeline_class(path)
    if not prebuilt:
        return pipeline_cls.from_pretrained(path, dtype=DTYPES[dtype], use_safetensors=use_safetensors)
    index = json.loads((path / "model_index.json").read_text())
    accepted = set(inspect.signature(pipeline_cls.__init__).parameters)
    kwargs = {}
    for name, value in index.items():
        if name.startswith("_") or name not in accepted:
            continue
        if not (isinstance(value, list) and len(value) == 2):
            kwargs[name] = value  # pipeline settings such as Wan2.2's boundary_ratio
        elif name in prebuilt:
            kwargs[name] = prebuilt[name]
        elif value[0] is None:
            kwargs[name] = None
        else:
            cls = getattr(importlib.import_module(value[0]), value[1])
            if isinstance(cls, type) and issubclass(cls, nn.Module):
                kwargs[name] = cls.from_pretrained(
                    path / name, dtype=DTYPES[dtype], use_safetensors=use_safetensors
                ).eval()
            else:  # tokenizers, schedulers, processors
                kwargs[name] = cls.from_pretrained(path / name)
    return pipeline_cls(**kwargs)


def model_index(path: Path) -> dict[str, tuple[str, str]]:
    """Component name -> (library, class name) of every present component of a pipeline folder."""
    index = json.loads((path / "model_index.json").read_text())
    return {
        name: (value[0], value[1])
        for name, value in index.items()
        if not name.startswith("_") and isinstance(value, list) and len(value) == 2 and value[0] and value[1]
    }


def pipeline_class(path: Path, name: str | None = None) -> type:
    """The diffusers pipeline class called ``name``, or without one that of a pipeline folder.

    Raises:
        ValueError: ``name`` is no diffusers pipeline class.
    """
    import diffusers

    name = name or json.loads((Path(path) / "model_index.json").read_text())["_class_name"]
    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        raise ValueError(f"pipeline_class {name!r} is not a diffusers pipeline class")
    return cls


def import_component_classes(path: Path) -> dict[str, type]:
    """Imports the class of every component of a pipeline folder (and the pipeline's own)."""
    classes = {name: getattr(importlib.import_module(lib), cls) for name, (lib, cls) in model_index(path).items()}
    classes["_pipeline"] = pipeline_class(path)
    return classes


def _fp32_patterns(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Module names the library itself keeps in float32 when loading in ``dtype``."""
    if dtype == torch.float32:
        return []
    if hasattr(model, "_get_dtype_plan"):  # transformers: its own per-dtype plan
        return list(model._get_dtype_plan(dtype))
    return list(getattr(model, "_keep_in_fp32_modules", None) or [])  # diffusers: any low dtype


def build_on_meta(folder: Path, library: str, class_name: str, dtype: str) -> nn.Module:
    """Builds a component from its config with parameters on the meta device and real buffers.

    Parameters get the dtypes the library's own loader would give them (``dtype``, except the
    modules it keeps in float32). Buffers are built for real because non-persistent ones (rotary
    tables) are not in checkpoints.
    """
    from accelerate import init_empty_weights

    cls = getattr(importlib.import_module(library), class_name)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"component {folder.name!r} is a {class_name}, not a module; it cannot be sharded")
    with init_empty_weights(include_buffers=False):
        if hasattr(cls, "load_config"):  # diffusers ModelMixin
            model = cls.from_config(cls.load_config(folder))
        else:  # transformers PreTrainedModel
            from transformers import AutoConfig

            model = cls(AutoConfig.from_pretrained(folder))
    if hasattr(model, "tie_weights"):
        # transformers ties shared embeddings at load time; tie them here (outside
        # init_empty_weights, which would re-create the parameter) so one answers to both names.
        model.tie_weights()
    target = DTYPES[dtype]
    keep = _fp32_patterns(model, target)
    for name, param in model.named_parameters():
        wanted = torch.float32 if any(k in name.split(".") for k in keep) else target
        param.data = param.data.to(wanted)
        param.requires_grad_(False)
    return model.eval()


def materialize(model: nn.Module, device: str) -> None:
    """Allocates the (sharded) parameters on ``device``, keeping the real buffers' values (a meta
    buffer is one the checkpoint fills: an FP8 folder's scales) and the parameters' ties."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    # to_empty gives each module a new parameter of its own: tied ones (a T5's shared embedding) are
    # tied again, so that the checkpoint's one tensor fills both names.
    for (first, first_name), *others in holders.values():
        for module, name in others:
            setattr(module, name, getattr(first, first_name))
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)


def _checkpoint_files(folder: Path, allow_pickle: bool) -> list[Path]:
    for stem in ("diffusion_pytorch_model", "model"):
        index = folder / f"{stem}.safetensors.index.json"
        if index.exists():
            return sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        if (folder / f"{stem}.safetensors").exists():
            return [folder / f"{stem}.safetensors"]
    pickles = sorted(folder.glob("*.bin"))
    if pickles and not allow_pickle:
        raise CheckpointError(
            f"{folder} holds only pickle checkpoints ({', '.join(p.name for p in pickles)}); "
            "loading pickle can run arbitrary code, so it needs allow_pickle=True"
        )
    if not pickles:
        raise CheckpointError(f"no safetensors checkpoint in {folder}")
    return pickles


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # an FP8 folder's linears (ray_hsdp.loading.fp8_folder)
}


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a buffer a file reads into, with no copy. (Not
    ``tensor.numpy()``: a storage numpy has seen can never be emptied again, and a sleeping model
    empties its storages: ``pipeline.residence``.)"""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class SafetensorsReader:
    """Reads whole tensors or row ranges of a safetensors file with plain file reads.

    ``safetensors.safe_open`` memory-maps the file, and every page a rank touches then counts in
    its resident memory until the file is closed: a rank reading its half of a single-file
    checkpoint would hold the whole file's worth. Reading the rows of a dim-0 shard straight into
    a tensor with ``readinto`` keeps a rank's host memory at its own slices.
    """

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        self.data_start = 8 + length
        self.header = header

    def keys(self):
        return self.header.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.header[key]["shape"])

    def extent(self, key: str, rows: slice | None = None) -> tuple[torch.dtype, list[int], int, int]:
        """``(dtype, shape, offset in the file, bytes)`` of tensor ``key``, or of rows ``rows`` of
        its first dimension."""
        entry = self.header[key]
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path.name}/{key}: unsupported safetensors dtype {entry['dtype']}")
        shape = list(entry["shape"])
        begin, end = entry["data_offsets"]
        if rows is not None and shape:
            row_bytes = (end - begin) // max(shape[0], 1)
            start, stop = rows.start, min(rows.stop, shape[0])
            begin, end = begin + start * row_bytes, begin + stop * row_bytes
            shape[0] = max(stop - start, 0)
        return dtype, shape, self.data_start + begin, end - begin

    def read(self, key: str, rows: slice | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor ``key``, or only rows ``rows`` of its first dimension.

        Args:
            key: Tensor name.
            rows: Rows of the first dimension to read; all when ``None``.
            out: Where to read into when it is a contiguous CPU tensor of the stored dtype and
                shape (no intermediate copy); otherwise a new tensor is returned.
        """
        dtype, shape, offset, _ = self.extent(key, rows)
        direct = out is not None and out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()
        if not (direct and list(out.shape) == shape):
            out = torch.empty(shape, dtype=dtype)
        if out.numel():
            with open(self.path, "rb") as f:
                f.seek(offset)
                f.readinto(_writable_bytes(out))
        return out

    def read_staged(self, key: str, rows: slice | None, out: torch.Tensor, staging: StagedReads) -> bool:
        """Reads into ``out`` on a GPU through ``staging``'s pinned buffers; whether it could (the
        stored dtype and shape are ``out``'s, and ``out`` is contiguous)."""
        dtype, shape, offset, nbytes = self.extent(key, rows)
        if dtype != out.dtype or list(out.shape) != shape or not out.is_contiguous():
            return False
        if nbytes:
            staging.read(self.path, offset, nbytes, out)
        return True


class _PickleReader:
    """The reader interface over a ``.bin`` file (opt-in only: unpickling can run code)."""

    def __init__(self, path: Path):
        self.path = path
        self.state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)

    def keys(self):
        return self.state.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.state[key].shape)

    def read(self, key: str, rows: slice | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        tensor = self.state[key]
        return tensor[rows] if rows is not None and tensor.dim() else tensor


def local_rows(param: torch.Tensor) -> slice | None:
    """Rows of the full tensor this rank holds; ``None`` for a whole (replicated) tensor.

    Raises:
        CheckpointError: The parameter is sharded on another dimension than the first.
    """
    if not isinstance(param, DTensor) or not param.dim():
        return None
    placements = tuple(param.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return slice(0, param.shape[0])
    if placements != (Shard(0),):
        raise CheckpointError(f"only dim-0 sharding is supported by the loader, got {param.placements}")
    mesh = param.device_mesh
    return rows_of(param.shape[0], mesh.size(), mesh.get_local_rank())


def model_key_names(model: nn.Module):
    """``name(checkpoint_key) -> the model's key``: transformers 5 renames some models' modules
    (Qwen2.5-VL's ``model.layers`` are ``model.language_model.layers``) and still writes and reads
    checkpoints under the old names, renaming at load; the same renamings here. A diffusers model:
    the key itself.

    Raises:
        CheckpointError: The model's checkpoints need a conversion of values (a fused or split
            tensor), which slice-wise loading cannot do.
    """
    if not hasattr(model, "config") or not hasattr(model.config, "model_type"):
        return lambda key: key
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if converters:
        raise CheckpointError(
            f"{type(model).__name__}: transformers converts this model's checkpoint values at load "
            f"({[c.source_patterns for c in converters]}), which loading by slices cannot do"
        )
    return lambda key: rename_source_key(key, renamings, [])[0]


def fill_from_checkpoint(model: nn.Module, folder: Path, allow_pickle: bool = False, model_key=None) -> dict:
    """Copies this rank's slice of every parameter and persistent buffer from the checkpoint.

    ``model_key`` names a checkpoint key's tensor in the model (``model_key_names`` of the model as
    built, before sharding renamed its classes). Tied parameters (one tensor under several names)
    are filled once from whichever name the checkpoint holds. The keys are matched first, so a
    mismatch fails before any byte is read; then ``READ_THREADS`` threads read the slices, each
    straight into its tensor on CPU, or through pinned buffers onto a GPU (``staged_reads``).

    Returns:
        ``{"files": n, "bytes_read": b}``: what this rank read.

    Raises:
        CheckpointError: A key of the checkpoint fits no tensor, a tensor got no key, or shapes differ.
    """
    targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    persistent = set(model.state_dict().keys())
    targets.update({n: b for n, b in model.named_buffers(remove_duplicate=False) if n in persistent})
    aliases: dict[int, list[str]] = {}
    for name, tensor in targets.items():
        aliases.setdefault(id(tensor), []).append(name)
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    filled: set[int] = set()
    unexpected: list[str] = []
    reads: list[tuple[SafetensorsReader | _PickleReader, str, torch.Tensor]] = []
    files = _checkpoint_files(folder, allow_pickle)
    model_key = model_key or model_key_names(model)
    for file in files:
        reader = _PickleReader(file) if file.suffix == ".bin" else SafetensorsReader(file)
        for key in reader.keys():
            target = targets.get(model_key(key))
            if target is None:
                if not any(p.search(key) for p in ignore):
                    unexpected.append(key)
                continue
            if id(target) in filled:
                continue
            if reader.shape(key) != tuple(target.shape):
                raise CheckpointError(
                    f"{folder.name}/{key}: checkpoint shape {reader.shape(key)} != model shape {tuple(target.shape)}"
                )
            reads.append((reader, key, target))
            filled.add(id(target))
    missing = sorted(names[0] for tid, names in aliases.items() if tid not in filled)
    if unexpected or missing:
        raise CheckpointError(
            f"checkpoint {folder} does not match {type(model).__name__}: "
            f"missing keys {missing[:20]}{' ...' if len(missing) > 20 else ''}; "
            f"unexpected keys {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}"
        )
    # Onto a GPU through pinned buffers, each thread's copies overlapping its next read.
    on_gpu = [t for _, _, t in reads if (t.to_local() if isinstance(t, DTensor) else t).is_cuda]
    stagings = ThreadStagings(on_gpu[0].device) if on_gpu else None
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ray_hsdp-read") as pool:
        bytes_read = sum(pool.map(lambda read: _fill(*read, stagings), reads))
    if stagings is not None:
        stagings.finish()
    return {"files": len(files), "bytes_read": bytes_read}


def _fill(
    reader: SafetensorsReader | _PickleReader, key: str, target: torch.Tensor, stagings: ThreadStagings | None
) -> int:
    """Reads ``key``'s slice into ``target``'s local tensor; returns the bytes read."""
    local = target.to_local() if isinstance(target, DTensor) else target
    rows = local_rows(target)
    if stagings is not None and isinstance(reader, SafetensorsReader):
        if reader.read_staged(key, rows, local, stagings.mine()):
            return local.numel() * local.element_size()
    with torch.no_grad():
        value = reader.read(key, rows, out=local)
        if (value.dtype == torch.float8_e4m3fn) != (local.dtype == torch.float8_e4m3fn):
            # copy_ would cast: FP8 values without their scales (or the reverse) are wrong weights.
            raise CheckpointError(
                f"{reader.path.name}/{key}: stored as {value.dtype}, the model holds {local.dtype} there "
                "(an FP8 folder loads with quantization: fp8, and only as `ray-hsdp quantize` wrote it)"
            )
        if value is not local:
            local.copy_(value)
    return value.numel() * value.element_size()
