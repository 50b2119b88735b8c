"""LoRA files applied whole (issue 75): each key of a file, after diffusers' own conversion, is
applied or the file is refused. Files in the formats users bring (``lora_files``), served per
request and merged at load on a 2-rank group, each equal to diffusers' ``load_lora_weights`` (and
``fuse_lora``) on the unsharded pipeline; on today's main the original-format file's ``diff_b``
keys (diffusers' ``lora_B.bias``) were dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_files import dora, original_wan, peft_with_bias, per_module_alphas
from safetensors.torch import load_file, save_file
from support import max_abs_diff, reference_frames

from ray_hsdp.checkpoints.lora import LORA_FILE
from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.loading.lora_state import read_adapter
from ray_hsdp.request import GenerationRequest, parse_lora


@pytest.fixture(scope="module")
def lora_dirs(reference_pipe, tmp_path_factory) -> dict[str, Path]:
    """The four files for the tiny Wan, by the adapter names the tests serve them under (DoRA's
    first: merged in this order, its row norms are those of the base weights)."""
    root = tmp_path_factory.mktemp("lora-files")
    transformer = reference_pipe.transformer
    return {
        "dora": dora(transformer, root / "dora"),
        "wan": original_wan(transformer, root / "wan"),
        "biased": peft_with_bias(transformer, root / "biased"),
        "alphas": per_module_alphas(type(reference_pipe), transformer, root / "alphas"),
    }


def diffusers_pipe(folder: str, lora_dirs: dict[str, Path]):
    """The unsharded pipeline with every file loaded by diffusers itself."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    for name, path in lora_dirs.items():
        pipe.load_lora_weights(str(path), adapter_name=name)
    return pipe


def request(rid: str, lora=(), **fields) -> GenerationRequest:
    base = dict(prompt="a fox runs in the snow", seed=3, num_inference_steps=3, num_frames=5, request_id=rid)
    return GenerationRequest(**{**base, **fields, "lora": parse_lora(lora)})


def test_what_each_file_applies_is_read_once_for_every_path(reference_pipe, lora_dirs):
    """The reading the three paths share: diff_b as lora_B.bias, DoRA's magnitudes, alphas and
    ranks per module from the metadata, an original-format alpha folded into the weights."""
    read = {name: read_adapter(type(reference_pipe), path, name) for name, path in lora_dirs.items()}
    linears = len(read["biased"].targets)
    assert linears == 40 and len(read["wan"].targets) == linears
    assert all(t.bias is not None for t in read["wan"].targets.values()) and read["wan"].config.lora_bias
    assert all(t.bias is not None for t in read["biased"].targets.values())
    assert read["dora"].dora and all(t.magnitude is not None for t in read["dora"].targets.values())
    assert len(read["dora"].targets) == 16  # the self-attention linears of its 4 blocks
    scalings = {name: t.scaling for name, t in read["alphas"].targets.items()}
    assert scalings["blocks.0.attn1.to_q"] == 4.0 and scalings["blocks.1.ffn.net.2"] == 2.0
    assert scalings["blocks.1.attn1.to_q"] == 1.0
    assert "with lora_B.bias" in read["wan"].summary() and "DoRA magnitudes" in read["dora"].summary()


def test_each_format_served_per_request_equals_diffusers(ray_cluster, tiny_model, lora_dirs):
    """2 ranks, each file's adapter on a request of its own (and none): each equals diffusers'
    load_lora_weights + set_adapters on the unsharded pipeline."""
    theirs = diffusers_pipe(tiny_model, lora_dirs)
    requests = [request(name, f"{name}:0.8") for name in lora_dirs] + [request("none")]
    loras = {name: str(path) for name, path in lora_dirs.items()}
    config = GroupConfig(model=tiny_model, device="cpu", shard_size=2, requests_per_rank=2, loras=loras)
    with ShardGroup(config) as group:
        results = group.generate(requests)
    plain = None
    for req, result in zip(requests, results):
        if req.lora:
            theirs.enable_lora()
            theirs.set_adapters([name for name, _ in req.lora], [scale for _, scale in req.lora])
        else:
            theirs.disable_lora()
        expected = reference_frames(theirs, req)
        assert max_abs_diff(result.frames, expected) <= 1e-5, req.request_id
        plain = expected if not req.lora else plain
    for req, result in zip(requests[:-1], results):  # every adapter changes the frames
        assert max_abs_diff(result.frames, plain) > 1e-3, req.request_id


def test_each_format_merged_at_load_equals_diffusers_fuse_lora(ray_cluster, tiny_model, lora_dirs):
    """2 ranks, all four merged into each rank's rows as it loads (bias rows, DoRA's per-row norm),
    against diffusers' fuse_lora of the same files at the same scale on whole weights."""
    theirs = diffusers_pipe(tiny_model, lora_dirs)
    theirs.set_adapters(list(lora_dirs))  # fuse_lora's lora_scale scales the active adapters only
    theirs.fuse_lora(lora_scale=0.7, adapter_names=list(lora_dirs))
    theirs.unload_lora_weights()  # the merged weights stay
    loras = {name: str(path) for name, path in lora_dirs.items()}
    config = GroupConfig(
        model=tiny_model, device="cpu", shard_size=2, loras=loras, fuse_loras=dict.fromkeys(lora_dirs, 0.7)
    )
    req = request("fused")
    with ShardGroup(config) as group:
        (result,) = group.generate([req])
    assert max_abs_diff(result.frames, reference_frames(theirs, req)) <= 1e-5


#: A linear of the PEFT file's keys.
Q = "transformer.blocks.0.attn1.to_q"


def _rewritten(path: Path, out: Path, change) -> Path:
    state = load_file(str(path / LORA_FILE))
    change(state)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / LORA_FILE))
    return out


@pytest.mark.parametrize(
    "change, refusal",
    [
        (lambda s: s.update({"transformer.blocks.0.norm2.weight": s[f"{Q}.lora_B.bias"].clone()}),
         r"keys that would not be applied: \['blocks.0.norm2.weight'\]"),
        (lambda s: s.update({"text_encoder.encoder.lora_A.weight": s[f"{Q}.lora_A.weight"].clone()}),
         r"keys for no transformer of the pipeline, which would not be applied: \['text_encoder.encoder"),
        (lambda s: s.pop("transformer.blocks.2.ffn.net.2.lora_B.weight"),
         r"lora_A or lora_B weights missing for \['blocks.2.ffn.net.2'\]"),
    ],
)  # fmt: skip
def test_a_file_with_a_key_it_would_not_apply_is_refused_naming_it(
    reference_pipe, lora_dirs, tmp_path, change, refusal
):  # noqa: E501
    path = _rewritten(lora_dirs["biased"], tmp_path / "changed", change)
    with pytest.raises(ValueError, match=refusal):
        read_adapter(type(reference_pipe), path, "lora 'changed'")


def test_a_config_that_leaves_keys_out_is_refused_where_diffusers_drops_them(reference_pipe, lora_dirs, tmp_path):
    """Metadata saying lora_bias false beside lora_B.bias keys: diffusers' PEFT load would drop the
    biases (unexpected keys); here the file is refused, naming them."""
    from ray_hsdp.checkpoints.lora import lora_targets

    state = {k[len("transformer.") :]: v for k, v in load_file(str(lora_dirs["biased"] / LORA_FILE)).items()}
    targets = sorted(lora_targets(reference_pipe.transformer))
    metadata = {"r": 4, "lora_alpha": 4, "target_modules": targets, "lora_bias": False}
    type(reference_pipe).save_lora_weights(
        tmp_path / "nobias", transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata
    )
    with pytest.raises(ValueError, match=r"lora_B.bias keys \(\['blocks.0.attn1.to_k'.*lora_bias false"):
        read_adapter(type(reference_pipe), tmp_path / "nobias", "lora 'nobias'")


def test_a_dora_merged_after_another_adapter_normalizes_by_the_unmerged_weight(reference_pipe, lora_dirs):
    """PEFT's merge, like its forward, measures a DoRA adapter's row norms on the base weight
    without the adapters merged before it: ``fuse_loras`` keeps those rows from before the first
    merge. The merged weights equal diffusers' (which recovers them by subtracting the merged deltas)."""
    from diffusers import DiffusionPipeline

    from ray_hsdp.loading.adapters import fuse_loras

    order = ["alphas", "dora"]
    theirs = diffusers_pipe(str(Path(reference_pipe.config._name_or_path)), {n: lora_dirs[n] for n in order})
    theirs.set_adapters(order)
    theirs.fuse_lora(lora_scale=0.7, adapter_names=order)
    theirs.unload_lora_weights()
    ours = DiffusionPipeline.from_pretrained(reference_pipe.config._name_or_path)
    fuse_loras(ours.transformer, [(read_adapter(type(ours), lora_dirs[n], n), 0.7) for n in order])
    expected = theirs.transformer.state_dict()
    merged = {k: float((v - expected[k]).abs().max()) for k, v in ours.transformer.state_dict().items()}
    assert max(merged.values()) <= 1e-5, max(merged.items(), key=lambda kv: kv[1])
    changed = [
        k for k, v in ours.transformer.state_dict().items() if not v.equal(reference_pipe.transformer.state_dict()[k])
    ]
    assert "blocks.0.attn1.to_q.weight" in changed and "blocks.0.attn1.to_q.bias" not in changed
