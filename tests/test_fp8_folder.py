"""FP8 folders (``ray-hsdp quantize``): a rank loads the stored FP8 linears as they are, and its
results equal quantizing at its start with the same configuration; a configuration that differs
from the folder's record is refused with what differs.

Served groups refuse FP8 on CPU (it is slower than float32 here); torch's CPU ``_scaled_mm`` still
runs, so the loads and forwards are checked at the level of the load steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import wan_transformer_inputs

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.loading.components import resolve_lora_path
from ray_hsdp.loading.fp8_folder import RECORD, check_stored_linears, stored_fp8_components
from ray_hsdp.sharding.fp8 import FP8, Fp8Linear

MIN_NUM_PARAMS = GroupConfig().min_num_params
#: The embedded adapter merged before quantizing: the scales are those of the merged weights.
FUSED = {"style": (0.5, {"transformer": "tiny-style"})}


def fused_paths() -> dict:
    return {
        name: (scale, {c: resolve_lora_path(s) for c, s in parts.items()}) for name, (scale, parts) in FUSED.items()
    }


@pytest.fixture(scope="module")
def fp8_folder(tiny_model, tmp_path_factory):
    """The tiny model's FP8 folder with ``style`` fused, written by the CLI."""
    out = tmp_path_factory.mktemp("fp8") / "tiny-fp8"
    subprocess.run(
        [sys.executable, "-m", "ray_hsdp.cli", "quantize", tiny_model, str(out), "--dtype", "float32",
         "--lora-file", "style=tiny-style", "--fuse-lora", "style:0.5"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return out


def load_facts(stored: frozenset[str]):
    from diffusers import WanPipeline

    from ray_hsdp.loading.steps import LoadFacts

    return LoadFacts(
        dtype="float32", device="cpu", mesh=None, min_num_params=MIN_NUM_PARAMS, gather="in_place",
        reshard_after_forward=True, forward_prefetch=1, keep_gathered=0.0, allow_pickle=False, cache_hooks=None,
        quantization="fp8", fused=fused_paths(), pipeline_cls=WanPipeline, fp8_stored=stored,
    )  # fmt: skip


def transformer_output(transformer) -> torch.Tensor:
    torch.manual_seed(0)
    inputs = wan_transformer_inputs(transformer.config)
    with torch.no_grad():
        return transformer(**inputs)[0]


def test_the_folder_stores_fp8_linears_with_their_scales_and_records_what_made_them(fp8_folder, tiny_model):
    from ray_hsdp.loading.components import SafetensorsReader

    record = json.loads((fp8_folder / RECORD).read_text())
    assert record["fuse_loras"] == {"style": 0.5} and record["dtype"] == "float32"
    assert record["min_num_params"] == MIN_NUM_PARAMS and record["torch"] == torch.__version__
    linears = record["components"]["transformer"]
    assert linears and set(record["components"]) == {"transformer"}
    reader = SafetensorsReader(fp8_folder / "transformer" / "diffusion_pytorch_model.safetensors")
    weight = reader.read(f"{linears[0]}.weight")
    scale = reader.read(f"{linears[0]}.weight_scale")
    assert weight.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (1, weight.shape[0])
    # The text encoder is the source's, byte for byte.
    source = sorted((p.name, p.read_bytes()) for p in (Path(tiny_model) / "text_encoder").iterdir())
    copied = sorted((p.name, p.read_bytes()) for p in (fp8_folder / "text_encoder").iterdir())
    assert copied == source


def test_a_rank_of_its_own_loads_the_fp8_folder_and_equals_quantizing_at_its_start(fp8_folder, tiny_model):
    """A group of one rank: the folder's transformer is built on the meta device and filled with
    its FP8 weights and scales (diffusers' loader would cast them), the fused adapter is not merged
    again, and the forward equals the source quantized at the start after the same merge."""
    from ray_hsdp.config.topology import ParallelDims
    from ray_hsdp.loading.steps import load_parts
    from ray_hsdp.phases import Phases

    def load(folder, stored):
        return load_parts(Path(folder), load_facts(stored), ("transformer", "text_encoder"), dims=ParallelDims(1, 1),
                          lane_mesh=None, backend=None, compile=False, phases=Phases("load"))  # fmt: skip

    stored = stored_fp8_components(
        fp8_folder, "fp8", "float32", MIN_NUM_PARAMS, {"style": 0.5}, torch.__version__, ("transformer", "text_encoder")
    )
    assert stored == {"transformer"}
    from_folder = load(fp8_folder, stored)
    at_start = load(tiny_model, frozenset())
    linears = [m for m in from_folder.pipe.transformer.modules() if isinstance(m, Fp8Linear)]
    assert linears and all(m.weight.dtype == FP8 for m in linears)
    assert torch.equal(transformer_output(from_folder.pipe.transformer), transformer_output(at_start.pipe.transformer))
    # What the rank read of the transformer: one byte per FP8 weight, not four.
    read = from_folder.stats["transformer"]["bytes_read"]
    assert read < 0.5 * sum(p.numel() * 4 for p in at_start.pipe.transformer.parameters())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quantization": "none"}, "serve it with quantization: fp8"),
        ({"dtype": "bfloat16"}, "with dtype='float32'; this configuration has dtype='bfloat16'"),
        ({"min_num_params": 10}, "with min_num_params=50000000; this configuration has min_num_params=10"),
        ({"fuse_loras": {}}, r"with fuse_loras=\{'style': 0.5\}; this configuration has fuse_loras=\{\}"),
        ({"torch_version": "2.9.1"}, "this configuration has torch='2.9'"),
        ({"shard_components": ("text_encoder",)}, r"for \['transformer'\], which shard_components"),
    ],
)
def test_a_configuration_other_than_the_folder_s_is_refused_with_what_differs(fp8_folder, change, message):
    given = dict(
        quantization="fp8", dtype="float32", min_num_params=MIN_NUM_PARAMS, fuse_loras={"style": 0.5},
        torch_version=torch.__version__, shard_components=("transformer", "text_encoder"),
    )  # fmt: skip
    with pytest.raises(ValueError, match=message):
        stored_fp8_components(fp8_folder, **{**given, **change})


def test_linears_other_than_the_stored_ones_are_refused(fp8_folder):
    stored = json.loads((fp8_folder / RECORD).read_text())["components"]["transformer"]
    check_stored_linears(fp8_folder, "transformer", list(reversed(stored)))
    with pytest.raises(ValueError, match="makes other linears of transformer FP8 than the folder stores"):
        check_stored_linears(fp8_folder, "transformer", stored[1:])


def test_check_refuses_a_configuration_the_folder_was_not_written_with(fp8_folder):
    """``ray-hsdp check`` runs the same comparison (all but torch's version, which is the ranks')."""
    from ray_hsdp.cli.check import check_app

    args = {"model": str(fp8_folder), "device": "cuda", "dtype": "float32", "shard_size": 1}
    refused = check_app("x", {**args, "quantization": "none"}, None, None, strict=True)
    assert any("serve it with quantization: fp8" in failure for failure in refused.failures), refused
    fused = {"quantization": "fp8", "loras": {"style": "tiny-style"}, "fuse_loras": {"style": 0.5}}
    assert check_app("x", {**args, **fused}, None, None, strict=True).failures == []


def test_another_file_under_a_fused_adapters_name_is_refused(fp8_folder):
    """Issue 73: the record keeps each fused adapter's file digest; the same name, scale and
    configuration with another file (the embedded ``tiny-detail`` registered as ``style``) would
    serve weights the folder does not hold: refused at the start and by check, naming the adapter."""
    from ray_hsdp.cli.check import check_app

    record = json.loads((fp8_folder / RECORD).read_text())
    assert set(record["fuse_lora_files"]) == {"style"} and len(record["fuse_lora_files"]["style"]["transformer"]) == 64
    given = dict(
        quantization="fp8", dtype="float32", min_num_params=MIN_NUM_PARAMS, fuse_loras={"style": 0.5},
        torch_version=torch.__version__, shard_components=("transformer",),
    )  # fmt: skip
    same = {"style": {"transformer": resolve_lora_path("tiny-style")}}
    assert stored_fp8_components(fp8_folder, **given, fused_files=same) == frozenset({"transformer"})
    other = {"style": {"transformer": resolve_lora_path("tiny-detail")}}
    message = r"with adapter 'style' \(transformer\) fused from another file than"
    with pytest.raises(ValueError, match=message):
        stored_fp8_components(fp8_folder, **given, fused_files=other)
    args = {"model": str(fp8_folder), "device": "cuda", "dtype": "float32", "shard_size": 1, "quantization": "fp8",
            "loras": {"style": "tiny-detail"}, "fuse_loras": {"style": 0.5}}  # fmt: skip
    assert any("fused from another file" in failure for failure in check_app("x", args, None, None, True).failures)


def test_quantize_into_a_folder_that_exists_is_refused(fp8_folder, tiny_model):
    again = subprocess.run(
        [sys.executable, "-m", "ray_hsdp.cli", "quantize", tiny_model, str(fp8_folder)],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 2 and f"{fp8_folder} exists; quantize into a new folder" in again.stderr
