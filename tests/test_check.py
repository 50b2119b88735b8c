"""``ray-hsdp check``: Serve YAMLs checked without starting Ray (``ray_hsdp.cli.check``): every shipped
YAML passes, a refused pair fails with the refusal's message, and the weights per GPU are read from
the model folder's safetensors headers."""

from __future__ import annotations

from pathlib import Path

import yaml
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(str(p) for p in (ROOT / "serve_configs").glob("*.yaml"))


def check(capsys, *argv: str) -> tuple[int, str]:
    from ray_hsdp.cli.commands import main

    capsys.readouterr()
    code = main(["check", *argv])
    return code, capsys.readouterr().out


def serve_yaml(tmp_path: Path, **args) -> str:
    path = tmp_path / "app.yaml"
    app = {"name": "app", "import_path": "ray_hsdp.serve:build_app", "args": args}
    path.write_text(yaml.safe_dump({"applications": [app]}))
    return str(path)


def test_every_shipped_yaml_passes(capsys):
    code, out = check(capsys, *SHIPPED)
    assert code == 0 and "FAILED" not in out, out
    assert out.count(": ok") >= len(SHIPPED)
    # The GPU YAMLs' folders are not on this machine: reported, and a failure only with --strict.
    gpu = [p for p in SHIPPED if "tiny" not in Path(p).name]
    assert "is not on this machine" in out
    assert check(capsys, "--strict", *gpu)[0] == 1


def test_a_refused_pair_fails_with_its_message(capsys, tmp_path):
    refused = serve_yaml(
        tmp_path, model="tiny", device="cpu", shard_size=4, lane_sizes=[1, 2, 4], cfg_parallel=True, lane_widening=True
    )
    code, out = check(capsys, refused)
    assert code == 1 and "app: FAILED" in out and "lane_widening with cfg_parallel" in out, out
    code, out = check(capsys, serve_yaml(tmp_path, model="tiny", quantization="fp8"), "--device", "cpu")
    assert code == 1 and "fp8" in out, out


def test_weights_per_gpu_come_from_the_safetensors_headers(capsys, tmp_path, tiny_model):
    folder = Path(tiny_model)
    elements = {}
    for part in ("transformer", "text_encoder", "vae"):
        total = 0
        for file in (folder / part).glob("*.safetensors"):
            with safe_open(file, "pt") as f:
                for key in f.keys():
                    count = 1
                    for dim in f.get_slice(key).get_shape():
                        count *= dim
                    total += count
        elements[part] = total
    code, out = check(capsys, serve_yaml(tmp_path, model=tiny_model, device="cpu", shard_size=2))
    assert code == 0, out
    gib = 1024**3
    assert all(count > 1000 for count in elements.values()), elements
    # float32 on CPU: 4 bytes an element; the transformer and text encoder sharded over 2, the VAE whole.
    assert f"transformer {elements['transformer'] * 4 / 2 / gib:.3f} GiB ({elements['transformer'] * 2} bytes)" in out
    assert f"text_encoder {elements['text_encoder'] * 2 / gib:.3f} GiB ({elements['text_encoder'] * 2} bytes)" in out
    assert f"vae {elements['vae'] * 4 / gib:.3f} GiB ({elements['vae'] * 4} bytes)" in out, out
    code, out = check(capsys, serve_yaml(tmp_path, model=tiny_model, device="cpu"), "--gpu-memory", "0.000001")
    assert code == 1 and "over --gpu-memory 1e-06 GiB" in out, out


def test_the_model_rows_fail_a_yaml_before_any_rank_starts(capsys, tmp_path, ray_cluster):
    """The table's model rows against the folder's transformer (built on the meta device from its
    config) and pipeline: what the ranks' load would refuse at start, found by ``check``."""
    from ray_hsdp.loading.components import resolve_model_path

    for name in ("tiny-hunyuanvideo-1.5", "tiny-flux2"):
        resolve_model_path(name)  # written as a rank writes it (the model tests use the same folders)
    hunyuan = {"model": "tiny-hunyuanvideo-1.5", "device": "cpu", "shard_size": 2}
    code, out = check(capsys, serve_yaml(tmp_path, **hunyuan, ulysses_degree=2))
    assert code == 1 and "HunyuanVideo15Transformer3DModel: a transformer without a context-parallel plan" in out, out
    code, out = check(capsys, serve_yaml(tmp_path, **hunyuan, cache={"kind": "first_block"}))
    assert code == 1 and "blocks diffusers' First Block Cache does not know" in out, out
    code, out = check(capsys, serve_yaml(tmp_path, **hunyuan, cfg_parallel=True, cache={"kind": "taylorseer"}))
    assert code == 0, out
    flux2 = serve_yaml(tmp_path, model="tiny-flux2", device="cpu", shard_size=2, cache={"kind": "taylorseer"})
    code, out = check(capsys, flux2)
    assert code == 1 and "Flux2Transformer2DModel: a pipeline that enters no cache context" in out, out


def test_check_fails_what_the_start_would_fail_with_the_starts_own_message(capsys, tmp_path, ray_cluster):
    """Each file here printed ``ok`` and then failed its group's start: ``check`` now runs the
    start's own checks (``ray_hsdp.loading.start_checks``) on the folder, so it fails them, with the
    message the start's load (``ShardedPipeline.load``, what every rank runs) raises."""
    import pytest

    from ray_hsdp.config.topology import ParallelDims
    from ray_hsdp.loading.components import resolve_model_path
    from ray_hsdp.pipeline.sharded import LoadOptions, ShardedPipeline

    cases = [
        ({"model": "tiny", "shard_size": 4, "ulysses_degree": 4}, ParallelDims(1, 4, ulysses=4),
         "ulysses_degree=4 does not divide the 2 attention heads of WanTransformer3DModel"),
        ({"model": "tiny", "shard_size": 2, "pipeline_class": "NoSuchPipeline"}, ParallelDims(1, 2),
         "pipeline_class 'NoSuchPipeline' is not a diffusers pipeline class"),
        ({"model": "tiny-flux2", "shard_size": 2, "cfg_parallel": True}, ParallelDims(1, 2, cfg=2),
         "cfg_parallel: no sharded component of Flux2Pipeline declares"),
    ]  # fmt: skip
    for args, dims, message in cases:
        code, out = check(capsys, serve_yaml(tmp_path, device="cpu", **args))
        assert code == 1 and message in out, (args, out)
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            ShardedPipeline.load(resolve_model_path(args["model"]), LoadOptions(
                dtype="float32", device="cpu", rank=0, mesh=None, dims=dims,
                shard_components=("transformer", "text_encoder"), min_num_params=1, reshard_after_forward=True,
                forward_prefetch=0, pipeline=args.get("pipeline_class"),
            ))  # fmt: skip
    # HunyuanVideo-1.5's attention always gets a mask, which sage's and fa3_fp8's kernels refuse.
    hunyuan = {"model": "tiny-hunyuanvideo-1.5", "shard_size": 2}
    for backend in ("sage", "fa3_fp8"):
        code, out = check(capsys, serve_yaml(tmp_path, **hunyuan, attention_backend=backend), "--device", "cuda")
        assert code == 1 and "whose attention always gets a mask (HunyuanVideo-1.5) with an attention_backend" in out
    wan = serve_yaml(tmp_path, model="tiny", shard_size=2, attention_backend="sage")
    assert check(capsys, wan, "--device", "cuda")[0] == 0  # a transformer without masks runs sage
    # A LoRA path that does not exist: a note (paths are the cluster's), a failure with --strict.
    lora = serve_yaml(tmp_path, model="tiny", device="cpu", shard_size=2, loras={"gone": str(tmp_path / "no-lora")})
    code, out = check(capsys, lora)
    assert code == 0 and "note: lora 'gone' (transformer)" in out and "is neither a file or folder" in out, out
    assert check(capsys, "--strict", lora)[0] == 1
    # A LoRA read as a rank reads it: what it applies; one with a key it would not apply, refused.
    from safetensors.torch import load_file, save_file

    from ray_hsdp.checkpoints.lora import LORA_FILE
    from ray_hsdp.loading.components import resolve_lora_path

    state = load_file(str(resolve_lora_path("tiny-style") / LORA_FILE))
    state["transformer.blocks.0.norm2.weight"] = state["transformer.blocks.0.attn1.to_q.lora_B.weight"][:, 0].clone()
    (tmp_path / "extra").mkdir()
    save_file(state, str(tmp_path / "extra" / LORA_FILE))
    loras = {"style": "tiny-style", "extra": str(tmp_path / "extra")}
    lora = serve_yaml(tmp_path, model="tiny", device="cpu", shard_size=2, loras=loras)
    code, out = check(capsys, lora)
    assert code == 0 and "note: lora 'style' (transformer) applies 40 linears (lora_A/lora_B)" in out, out
    assert "note: lora 'extra' (transformer): keys that would not be applied: ['blocks.0.norm2.weight']" in out, out
    assert check(capsys, "--strict", lora)[0] == 1


def test_an_embedded_model_never_written_here_is_written_and_checked(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_HSDP_HOME", str(tmp_path / "fresh"))
    code, out = check(capsys, serve_yaml(tmp_path, model="tiny", device="cpu", shard_size=4, ulysses_degree=4))
    assert code == 1 and "does not divide the 2 attention heads" in out, out
    assert (tmp_path / "fresh").is_dir() and "first start" not in out


def test_weights_per_gpu_count_keep_gathered_and_fp8(capsys, tmp_path, tiny_model):
    import re

    from ray_hsdp.loading.components import build_on_meta, model_index

    folder = Path(tiny_model)
    meta = build_on_meta(folder / "transformer", *model_index(folder)["transformer"], "bfloat16")
    whole = sum(p.numel() * p.element_size() for p in meta.parameters())

    def transformer_bytes(**args) -> int:
        code, out = check(capsys, serve_yaml(tmp_path, model=tiny_model, shard_size=2, **args), "--device", "cuda")
        assert code == 0, out
        return int(re.search(r"transformer [\d.]+ GiB \((\d+) bytes\)", out).group(1))

    sharded = transformer_bytes()
    assert sharded < 0.6 * whole
    assert transformer_bytes(keep_gathered=1.0) == whole  # every unit and the root whole on every GPU
    assert sharded < transformer_bytes(keep_gathered=0.5) < whole
    # FP8: the units' linears (those the ranks swap) at a byte a weight instead of two, each row's
    # float32 scale whole on every GPU.
    from ray_hsdp.sharding.fp8 import fp8_candidates
    from ray_hsdp.sharding.policy import resolve_plan

    linears = [linear for *_, linear in fp8_candidates(resolve_plan(meta, 50_000_000))]
    assert linears
    # Each rank's half of a weight: 2 bytes an element in bfloat16, 1 in FP8; the scales whole.
    saved = sum(linear.weight.numel() * (2 - 1) // 2 - linear.out_features * 4 for linear in linears)
    assert transformer_bytes(quantization="fp8") == sharded - saved


def test_a_warm_up_shape_the_model_refuses_fails_check_before_any_weight(capsys, tmp_path):
    """Issue 73: the start's own check of the warm-up shapes (``serve.replica.warm_up.check_shapes``) runs in
    check: 8 frames on Wan (its VAE takes 4k+1) fail with the start's message; HunyuanVideo-1.5's
    image-to-video pipeline, whose output follows its image, warms without a size (before, every
    warm-up sent one, which that call refuses after a full weight load)."""
    eight = serve_yaml(tmp_path, model="tiny", device="cpu", warm_up=[{"size": "64x64", "num_frames": 8}])
    code, out = check(capsys, eight)
    assert code == 1 and "num_frames=8 is not a count this model's VAE takes" in out, out
    i2v = serve_yaml(
        tmp_path, model="tiny-hunyuanvideo-1.5", pipeline_class="HunyuanVideo15ImageToVideoPipeline", device="cpu",
        compile=True,
    )  # fmt: skip
    code, out = check(capsys, i2v)
    assert code == 0 and "app: ok" in out, out


def test_a_warm_up_request_of_a_pipeline_that_takes_no_size_gives_none():
    from ray_hsdp.config.app import AppConfig
    from ray_hsdp.config.blocks import WarmUpShape
    from ray_hsdp.loading.components import resolve_model_path
    from ray_hsdp.loading.start_checks import pipeline_on_meta
    from ray_hsdp.pipeline.sharded import call_facts
    from ray_hsdp.serve.replica.warm_up import warm_up_request

    pipeline = "HunyuanVideo15ImageToVideoPipeline"
    config = AppConfig(model="tiny-hunyuanvideo-1.5", pipeline_class=pipeline, device="cpu")
    facts = call_facts(pipeline_on_meta(resolve_model_path(config.model), pipeline))
    request, fps = warm_up_request(WarmUpShape(size="64x48"), config, facts, 0)
    assert not request.size_given and request.image is not None and fps > 0


def test_a_gpu_share_says_which_models_fit_awake_together_and_the_host_memory_they_need(capsys, tmp_path):
    """Issue 83: per share, each model's bytes per GPU, how many fit awake within the budget, and the
    host memory of their weights asleep; a model over the budget fails the file."""
    path = tmp_path / "share.yaml"

    def write(budget):
        share = {"device": "cpu", "shard_size": 2, "gpu_share": "s", "gpu_share_budget_gib": budget}
        models = [{"model": "tiny", "model_name": "a", **share}]
        models.append({"model": "tiny-qwen-image", "model_name": "b", **share})
        app = {"name": "x", "route_prefix": "/", "import_path": "ray_hsdp.serve:build_app", "args": {"models": models}}
        path.write_text(yaml.safe_dump({"applications": [app]}))
        return str(path)

    code, out = check(capsys, write(1.0))
    assert code == 0 and "gpu_share s: 2 model(s) on 2 GPU(s) of one node" in out, out
    assert "awake together: at most 2 of 2 (gpu_share_budget_gib 1)" in out
    per_gpu = [float(line.split()[-2]) for line in out.splitlines() if "weights per GPU in all" in line]
    host_gib = float(out.split("host memory for their weights asleep: ")[1].split()[0])
    assert per_gpu and abs(host_gib - 2 * sum(per_gpu)) <= 0.01
    code, out = check(capsys, write(0.0004))  # holds the tiny Wan (0.0005 GiB per GPU) alone, never both
    assert code != 0 and "exceeds gpu_share_budget_gib" in out, out


def test_scheduler_settings_the_folders_scheduler_lacks_fail_check_with_the_starts_message(capsys, tmp_path):
    """diffusers' ``from_config`` would drop a setting its scheduler does not have: the start (and
    ``check``) refuses it by name; a setting it has passes."""
    bad = serve_yaml(tmp_path, model="tiny", device="cpu", scheduler_config={"base_shfit": 1.1})
    code, out = check(capsys, bad)
    assert code == 1 and "scheduler_config sets ['base_shfit']" in out, out
    good = serve_yaml(tmp_path, model="tiny", device="cpu", scheduler_config={"shift": 3.0}, sample_solver="euler")
    assert check(capsys, good)[0] == 0
