"""``ray-hsdp check``: Serve YAMLs checked without starting Ray (``ray_hsdp.check``): every shipped
YAML passes, a refused pair fails with the refusal's message, and the weights per GPU are read from
the model folder's safetensors headers."""

from __future__ import annotations

from pathlib import Path

import yaml
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(str(p) for p in (ROOT / "serve_configs").glob("*.yaml"))


def check(capsys, *argv: str) -> tuple[int, str]:
    from ray_hsdp.cli import main

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
    from ray_hsdp.loading import resolve_model_path

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
