"""LoRA adapters chosen per request (issue 22): loaded into the sharded transformers at start, switched
by the tick thread before each forward, so requests with different adapters (or none) run on one
group at the same ticks, each equal to diffusers' own ``load_lora_weights`` + ``set_adapters`` on
the unsharded pipeline."""

from __future__ import annotations

import pytest
from support import max_abs_diff, reference_frames

from ray_hsdp.checkpoints.tiny import make_tiny
from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.request import GenerationRequest, parse_lora

#: The embedded tiny model's two random adapters, under the names requests use.
LORAS = {"style": "tiny-style", "detail": "tiny-detail"}


@pytest.fixture(scope="module")
def lora_pipe(ray_cluster, tiny_model):
    """The unsharded tiny pipeline with both adapters, loaded by diffusers itself."""
    from diffusers import DiffusionPipeline

    from ray_hsdp.loading.components import resolve_lora_path

    pipe = DiffusionPipeline.from_pretrained(tiny_model)
    pipe.set_progress_bar_config(disable=True)
    for name, source in LORAS.items():
        pipe.load_lora_weights(str(resolve_lora_path(source)), adapter_name=name)
    return pipe


def reference(pipe, request: GenerationRequest):
    """The unsharded run of ``request`` with its adapters set the diffusers way."""
    if request.lora:
        pipe.enable_lora()
        pipe.set_adapters([name for name, _ in request.lora], [scale for _, scale in request.lora])
    else:
        pipe.disable_lora()
    return reference_frames(pipe, request)


def request(rid: str, lora=(), **fields) -> GenerationRequest:
    base = dict(prompt="a cat bakes a cake", seed=1, num_inference_steps=4, num_frames=5, request_id=rid)
    return GenerationRequest(**{**base, **fields, "lora": parse_lora(lora)})


def test_the_forms_a_client_sends_read_as_name_scale_pairs():
    assert parse_lora(None) == parse_lora("") == parse_lora([]) == ()
    assert parse_lora("style") == (("style", 1.0),)
    assert parse_lora("style:0.5, detail") == (("style", 0.5), ("detail", 1.0))
    assert parse_lora(["style", {"name": "detail", "scale": "0.25"}]) == (("style", 1.0), ("detail", 0.25))
    for bad, message in [
        ("style:abc", "the scale must be a number"),
        ([{"name": "style", "scale": True}], "the scale must be a number"),
        ("style:nan", "must be finite"),
        ([{"scale": 1}], "expected a name"),
        ("style,style:0.5", "twice"),
        (5, "lora must be a name"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_lora(bad)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"loras": {"a:b": "x"}}, "no ',', ':' or spaces"),
        ({"loras": {"pair": {"transformer_3": "x"}}}, "a pair names transformer and/or transformer_2"),
        ({"loras": {"a": "x", "b": "y"}, "max_loras": 1}, "max_loras=1"),
        ({"loras": {"a": "x"}, "compile": True}, "would recompile"),
        ({"loras": {"a": "x"}, "shard_size": 1, "requests_per_rank": 2}, "use requests_per_rank 1"),
        ({"loras": {"a": "x"}, "fuse_loras": {"b": 1.0}}, "fuse_loras names 'b', which loras does not register"),
        ({"loras": {"a": "x"}, "fuse_loras": {"a": float("nan")}}, "must be finite"),
        ({"loras": {"a": "x", "b": "y"}, "fuse_loras": {"a": 1.0}, "compile": True}, r"fuse_loras\) with compile"),
        ({"loras": {"a": "x"}, "lora_defaults": {"b": {"num_inference_steps": 4}}}, "lora_defaults names"),
        ({"loras": {"a": "x"}, "lora_defaults": {"a": {"num_inference_steps": 999}}}, "exceeds max_steps=200"),
    ],
)
def test_bad_lora_configs_are_refused_with_the_rule(fields, message):
    with pytest.raises(ValueError, match=message):
        AppConfig(model="tiny", device="cpu", **fields)


def test_merged_adapters_need_no_switch_so_they_compile():
    config = GroupConfig(model="tiny", loras={"turbo": "x"}, fuse_loras={"turbo": 1.0}, compile=True)
    assert config.lora_sources(fused=False) == {} and list(config.lora_sources(fused=True)) == ["turbo"]


def test_a_request_takes_the_defaults_of_the_adapters_it_names():
    """A fused distillation LoRA sets every request's steps and guidance; a named adapter's defaults
    win over the fused ones; a request's own values win over both (the server's mapping)."""
    from ray_hsdp.serve.errors import RequestLimitError
    from ray_hsdp.serve.schema import ImageGenerationRequest, to_generation_request

    config = AppConfig(
        model="tiny",
        loras={"turbo": "t", "style": "s", "detail": "d", "slow": "x"},
        fuse_loras={"turbo": 1.0},
        lora_defaults={
            "turbo": {"num_inference_steps": 4, "guidance_scale": 1.0},
            "style": {"num_inference_steps": 8},
            "slow": {"num_inference_steps": 40, "guidance_scale_2": 3.0},
            "detail": {"flow_shift": 3.0},
        },
    )

    def mapped(**body):
        request = to_generation_request(ImageGenerationRequest(prompt="a", **body), config, "r")
        return request.num_inference_steps, request.guidance_scale, request.guidance_scale_2

    assert mapped() == (4, 1.0, None)
    shifts = [
        to_generation_request(ImageGenerationRequest(prompt="a", **body), config, "r").flow_shift
        for body in ({}, {"lora": "detail"}, {"lora": "detail", "flow_shift": 8})
    ]
    assert shifts == [None, 3.0, 8.0]
    assert mapped(lora="style:0.5,detail") == (8, 1.0, None)
    assert mapped(lora="slow") == (40, 1.0, 3.0)
    assert mapped(lora="style", num_inference_steps=6, guidance_scale=3) == (6, 3.0, None)
    with pytest.raises(RequestLimitError, match="'style' and 'slow' default num_inference_steps to 8 and 40"):
        mapped(lora="style,slow")
    assert mapped(lora="style,slow", num_inference_steps=12) == (12, 1.0, 3.0)
    assert AppConfig(model="tiny").request_defaults(()) == {"num_inference_steps": 30, "guidance_scale": 5.0}


def test_requests_with_different_adapters_share_the_ticks_of_one_batch_group(lora_pipe, tiny_model):
    """2 ranks, 2 requests each: one adapter, two combined, none, and the first at half scale, all at
    once; each equals its unsharded run, and the ranks ran forwards at the same ticks."""
    requests = [
        request("style", "style"),
        request("mixed", "detail:0.5,style:0.5", prompt="a red fox in the snow", seed=2),
        request("none", prompt="waves on rocks", seed=3),
        request("half", "style:0.5"),
    ]
    config = GroupConfig(model=tiny_model, device="cpu", shard_size=2, requests_per_rank=2, loras=LORAS)
    with ShardGroup(config) as group:
        with pytest.raises(ValueError, match="unknown lora 'nope'; this deployment's adapters: detail, style"):
            group.submit(request("bad", "nope"))
        with pytest.raises(ValueError, match="max_loras_per_request=4"):
            group.submit(request("many", [f"x{i}" for i in range(5)]))
        group.start_profile()
        results = group.generate(requests)
        profiles = group.stop_profile()
    frames = {}
    for req, result in zip(requests, results):
        assert max_abs_diff(result.frames, reference(lora_pipe, req)) <= 1e-5, req.request_id
        frames[req.request_id] = result.frames
    # The adapters reach the frames: the same prompt and seed differ by adapter scale and from none.
    plain = reference(lora_pipe, request("plain"))
    assert max_abs_diff(frames["style"], plain) > 1e-3 and max_abs_diff(frames["style"], frames["half"]) > 1e-4
    placed = {rid: p["rank"] for p in profiles for rid in p["requests"]}
    assert sorted(placed.values()) == [0, 0, 1, 1]  # two requests on each rank, at once
    together = set(profiles[0]["forward_ticks"]) & set(profiles[1]["forward_ticks"])
    assert len(together) >= 4, profiles


def test_a_lane_of_ulysses_2_runs_its_request_adapters_on_both_ranks(lora_pipe, tiny_model):
    """Gathered in place (CUDA's default): the adapters wrap linears whose weights are views of the
    unit's gather buffers."""
    requests = [request("lane-style", "style:0.7"), request("lane-none", prompt="a small boat", seed=4)]
    config = GroupConfig(model=tiny_model, device="cpu", shard_size=2, ulysses_degree=2, gather="in_place", loras=LORAS)
    with ShardGroup(config) as group:
        results = group.generate(requests)
    for req, result in zip(requests, results):
        assert max_abs_diff(result.frames, reference(lora_pipe, req)) <= 1e-5, req.request_id


def test_pairs_merged_at_load_and_switched_per_request_on_two_experts(ray_cluster, tmp_path):
    """Wan2.2's two experts, gathered in place (CUDA's default): ``fast`` is merged into both experts'
    weights as each rank loads its rows (diffusers' ``fuse_lora`` on the whole pipeline gives the same),
    ``turbo`` is switched per request, its high-noise half in transformer and its low-noise half in
    transformer_2 (diffusers' load_into_transformer_2), one name for both."""
    from diffusers import DiffusionPipeline

    from ray_hsdp.loading.components import resolve_lora_path

    folder = make_tiny(tmp_path / "wan22", two_experts=True)
    high, low = (str(resolve_lora_path(source)) for source in ("tiny-style", "tiny-detail"))
    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(low, adapter_name="fast")
    pipe.load_lora_weights(high, adapter_name="fast", load_into_transformer_2=True)
    pipe.fuse_lora(components=["transformer", "transformer_2"], lora_scale=0.6, adapter_names=["fast"])
    pipe.unload_lora_weights()  # the merged weights stay; the layers go
    pipe.load_lora_weights(high, adapter_name="turbo")
    pipe.load_lora_weights(low, adapter_name="turbo", load_into_transformer_2=True)
    requests = [request("pair", "turbo:0.8", num_inference_steps=6), request("bare", num_inference_steps=6, seed=5)]
    loras = {"turbo": {"transformer": high, "transformer_2": low}, "fast": {"transformer": low, "transformer_2": high}}
    config = GroupConfig(
        model=str(folder), device="cpu", shard_size=2, gather="in_place", loras=loras, fuse_loras={"fast": 0.6}
    )
    with ShardGroup(config) as group:
        with pytest.raises(ValueError, match=r"fuse_loras with a request naming a fused adapter \(lora\)"):
            group.submit(request("named", "fast"))
        results = group.generate(requests)
    for req, result in zip(requests, results):
        assert max_abs_diff(result.frames, reference(pipe, req)) <= 1e-5, req.request_id


def test_a_lora_of_another_architecture_is_refused_naming_its_modules(lora_pipe, tiny_model, tmp_path):
    """What a rank does at start (``Adapters.load``), on the unsharded pipeline: a Flux LoRA names
    modules a Wan transformer does not have."""
    from diffusers import DiffusionPipeline

    from ray_hsdp.checkpoints.lora import make_random_lora
    from ray_hsdp.loading.adapters import Adapters

    make_random_lora("flux.1-dev", tmp_path / "flux-lora", rank=4, tiny=True, dtype="float32")
    pipe = DiffusionPipeline.from_pretrained(tiny_model)
    refusal = r"lora 'flux' .* for transformer of WanPipeline: the model has no modules"
    with pytest.raises(ValueError, match=refusal) as refused:
        Adapters.load(pipe, {"flux": {"transformer": tmp_path / "flux-lora"}})
    assert "transformer_blocks.0." in str(refused.value)


def test_a_file_stating_its_alpha_runs_at_diffusers_scale(lora_pipe, tiny_model, tmp_path):
    """A LoRA that diffusers saved with its config (lora_alpha 2 x rank: every update doubled) loads
    at the scale diffusers' own loader gives it, on the unsharded pipeline as a rank loads it."""
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    from ray_hsdp.checkpoints.lora import LORA_FILE
    from ray_hsdp.loading.adapters import Adapters
    from ray_hsdp.loading.components import resolve_lora_path

    prefix = "transformer."
    weights = {k[len(prefix) :]: v for k, v in load_file(str(resolve_lora_path("tiny-style") / LORA_FILE)).items()}
    targets = sorted({k.rsplit(".lora_", 1)[0] for k in weights})
    metadata = {"r": 4, "lora_alpha": 8, "target_modules": targets}
    type(lora_pipe).save_lora_weights(
        tmp_path / "alpha8", transformer_lora_layers=weights, transformer_lora_adapter_metadata=metadata
    )
    theirs = DiffusionPipeline.from_pretrained(tiny_model)
    theirs.set_progress_bar_config(disable=True)
    theirs.load_lora_weights(str(tmp_path / "alpha8"), adapter_name="a8")
    ours = DiffusionPipeline.from_pretrained(tiny_model)
    ours.set_progress_bar_config(disable=True)
    adapters = Adapters.load(ours, {"a8": {"transformer": tmp_path / "alpha8"}})
    adapters.select((("a8", 0.5),))
    req = request("alpha", "a8:0.5")
    assert max_abs_diff(reference_frames(ours, req), reference(theirs, req)) <= 1e-6


def test_a_merged_lora_equals_diffusers_fuse_lora_on_whole_weights(lora_pipe, tiny_model, tmp_path):
    """One rank (plain weights, the rows of a shard being all of them): a file stating lora_alpha 2 x
    rank, merged at 0.7, against diffusers' ``fuse_lora`` of the same file."""
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    from ray_hsdp.checkpoints.lora import LORA_FILE
    from ray_hsdp.loading.adapters import fuse_lora
    from ray_hsdp.loading.components import resolve_lora_path
    from ray_hsdp.loading.lora_state import read_adapter

    prefix = "transformer."
    weights = {k[len(prefix) :]: v for k, v in load_file(str(resolve_lora_path("tiny-detail") / LORA_FILE)).items()}
    targets = sorted({k.rsplit(".lora_", 1)[0] for k in weights})
    type(lora_pipe).save_lora_weights(
        tmp_path / "alpha8",
        transformer_lora_layers=weights,
        transformer_lora_adapter_metadata={"r": 4, "lora_alpha": 8, "target_modules": targets},
    )
    theirs = DiffusionPipeline.from_pretrained(tiny_model)
    theirs.set_progress_bar_config(disable=True)
    theirs.load_lora_weights(str(tmp_path / "alpha8"), adapter_name="a8")
    theirs.fuse_lora(lora_scale=0.7, adapter_names=["a8"])
    theirs.unload_lora_weights()
    ours = DiffusionPipeline.from_pretrained(tiny_model)
    ours.set_progress_bar_config(disable=True)
    adapter = read_adapter(type(ours), tmp_path / "alpha8", "a8")
    assert {t.scaling for t in adapter.targets.values()} == {2.0}
    assert fuse_lora(ours.transformer, adapter, 0.7) == len(targets)
    req = request("fused")
    assert max_abs_diff(reference_frames(ours, req), reference_frames(theirs, req)) <= 1e-6
