"""The ray-hsdp console script, run as a user runs it: commands that start Ray in a process of their
own; quick ones (making checkpoints, refusing bad flags) through ``main`` in this process, which
spares a Python start each."""

import base64
import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from PIL import Image
from support import free_port, wait_until_healthy

CLI = str(Path(sys.executable).with_name("ray-hsdp"))


def run(*args, env=None, timeout=300):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout, env=env or os.environ.copy())


def run_here(capsys, *args) -> subprocess.CompletedProcess:
    """``ray-hsdp ARGS`` through ``main`` in this process: its exit code (argparse's refusals
    included), stdout and stderr."""
    from ray_hsdp.cli.commands import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["ray-hsdp", *args], code, out, err)


def test_make_tiny_writes_a_loadable_pipeline_and_refuses_to_overwrite(tmp_path, capsys):
    from diffusers import DiffusionPipeline

    target = tmp_path / "tiny"
    done = run_here(capsys, "make-tiny", str(target), "--two-experts")
    assert done.returncode == 0, done.stderr
    pipe = DiffusionPipeline.from_pretrained(target)
    assert type(pipe).__name__ == "WanPipeline"
    assert pipe.transformer_2 is not None and pipe.config.boundary_ratio == 0.5
    assert all(p.suffix != ".bin" for p in target.rglob("*") if p.is_file())
    again = run_here(capsys, "make-tiny", str(target))
    assert again.returncode == 2 and "already holds a diffusers pipeline" in again.stderr


def test_generate_runs_a_group_without_serve_and_writes_a_video(ray_cluster, tiny_model, tmp_path, capsys):
    """(Images from the CLI: the demo's test.)"""
    from ray_hsdp.serve.media import decode_mp4

    out = tmp_path / "fox.mp4"
    args = ["generate", tiny_model, "--prompt", "a fox", "--frames", "9", "--steps", "3", "--device", "cpu"]
    done = run(*args, "--size", "96x64", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    frames, fps = decode_mp4(out.read_bytes())
    assert frames.shape == (9, 64, 96, 3) and fps == 16
    assert "9 frames at 16 fps" in done.stdout
    assert re.search(r"^1\s+1\s+\S+\s+cpu\s", done.stdout, re.M), done.stdout  # rank 1, its own lane
    bad = run_here(capsys, *args[:5], "8", *args[6:], "--out", str(tmp_path / "bad.mp4"))
    assert bad.returncode == 2 and "4k+1" in bad.stderr


def test_demo_prints_the_image_path_and_the_memory_table(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = run("demo", "--port", str(free_port()), "--out", str(tmp_path / "demo.png"), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    paths = [Path(line.strip()) for line in done.stdout.splitlines() if line.strip().endswith(".png")]
    assert len(paths) == 2 and all(Image.open(p).size == (64, 64) for p in paths)
    (video,) = [Path(line.strip()) for line in done.stdout.splitlines() if line.strip().endswith(".mp4")]
    assert video.read_bytes()[4:8] == b"ftyp"
    shares = [float(s) for s in re.findall(r"^\d\s+.*?\s(\d+\.\d)%", done.stdout, re.M)]
    assert len(shares) == 2 and all(45 <= s <= 55 for s in shares), done.stdout
    # Issue 74: the demo's own Ray preloads what a rank imports: both ranks' processes had imported it.
    assert len(re.findall(r"^\d\s+.*\spreloaded\s*$", done.stdout, re.M)) == 2, done.stdout


def test_fp8_on_cpu_is_refused_before_ray_starts(capsys):
    done = run_here(capsys, "generate", "tiny", "--prompt", "a fox", "--device", "cpu", "--quantization", "fp8")
    assert done.returncode == 2 and "FP8 tensor cores" in done.stderr, done.stderr


def test_usp_without_use_hsdp_is_refused_with_the_fix(capsys):
    done = run_here(capsys, "serve", "tiny", "--usp", "2", "--device", "cpu")
    assert done.returncode == 2 and "add --use-hsdp" in done.stderr


def test_make_random_tiny_then_serve_it_over_http_with_usp_2(ray_cluster, tmp_path, capsys):
    """As vllm-omni users type it: --use-hsdp --usp 2, no shard size (it defaults to the lane's 2),
    with a field reached by --set. The API key is in the command's environment only (not in the
    cluster's nodes'): it reaches the replicas, which refuse a request without it. The application
    is named after the model folder, and Ctrl-C removes it alone: another application on the same
    Serve keeps running."""
    import requests

    folder = tmp_path / "wan14b-tiny"
    done = run_here(capsys, "make-random", "wan2.1-t2v-14b", str(folder), "--tiny")
    assert done.returncode == 0, done.stderr
    assert "stand-ins" in done.stdout and "tiny variant" in done.stdout
    from ray import serve

    serve.shutdown()  # a Serve left on the shared cluster would keep its own HTTP port
    port = free_port()
    proc = subprocess.Popen(
        [
            CLI,
            "serve",
            str(folder),
            "--use-hsdp",
            "--usp",
            "2",
            "--device",
            "cpu",
            "--default-size",
            "64x64",
            "--default-steps",
            "2",
            "--set",
            "max_steps=50",
            "--port",
            str(port),
        ],
        # A file, not a pipe: an unread pipe fills with Ray's logs and blocks the server's exit.
        stdout=open(tmp_path / "serve.log", "w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "RAY_HSDP_API_KEY": "cli-secret"},
    )
    key = {"Authorization": "Bearer cli-secret"}
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(base, proc)
        body = {"prompt": "a fox", "seed": 1}
        assert requests.post(f"{base}/v1/images/generations", json=body, timeout=120).status_code == 401
        response = requests.post(f"{base}/v1/images/generations", json=body, headers=key, timeout=120)
        assert response.status_code == 200, response.text
        png = base64.b64decode(response.json()["data"][0]["b64_json"])
        assert Image.open(io.BytesIO(png)).size == (64, 64)
        pool = requests.get(f"{base}/v1/pool", headers=key, timeout=60).json()
        assert pool["shard_size"] == 2 and pool["model"] == "wan14b-tiny"
        assert (pool["lanes"], pool["lane_size"], pool["ulysses_degree"]) == (1, 2, 2)
        too_many = requests.post(
            f"{base}/v1/images/generations", json={"prompt": "a", "num_inference_steps": 51}, headers=key, timeout=60
        )
        assert too_many.status_code == 400 and "max_steps=50" in too_many.text
        bystander = serve.deployment(lambda request: "still here", ray_actor_options={"num_cpus": 0})
        serve.run(bystander.bind(), name="bystander", route_prefix="/bystander")
        assert set(serve.status().applications) >= {"wan14b-tiny", "bystander"}
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "wan14b-tiny" not in serve.status().applications
        assert requests.get(f"{base}/bystander", timeout=30).text == "still here"
    finally:
        # Later tests find the cluster's CPUs free.
        serve.shutdown()
        if proc.poll() is None:
            proc.kill()


def test_make_random_lora_writes_a_lora_diffusers_loads(tmp_path, capsys):
    from safetensors import safe_open

    done = run_here(capsys, "make-random-lora", "wan2.1-t2v-14b", str(tmp_path / "lora"), "--tiny", "--rank", "4")
    assert done.returncode == 0, done.stderr
    assert "Wrote a random rank-4 LoRA for wan2.1-t2v-14b" in done.stdout
    with safe_open(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert f.get_tensor("transformer.blocks.0.attn1.to_q.lora_A.weight").shape == (4, 32)
    layers = int(re.search(r"(\d+) linear layers", done.stdout).group(1))
    assert len(keys) == 2 * layers and all(k.startswith("transformer.blocks.") for k in keys)


def test_make_random_lora_writes_lightx2v_s_layout(tmp_path, capsys):
    """``--layout wan``: the original Wan repo's keys, as lightx2v's 4-step LoRAs carry them (the
    shipped few-step YAMLs' test loads such files: tests/serve/test_few_step_configs.py)."""
    from safetensors import safe_open

    done = run_here(capsys, "make-random-lora", "wan2.1-t2v-14b", str(tmp_path / "lora"), "--tiny", "--layout", "wan")
    assert done.returncode == 0, done.stderr
    with safe_open(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors"), "pt") as f:
        keys = set(f.keys())
    key = "diffusion_model.blocks.0.self_attn.q"
    assert {f"{key}.lora_down.weight", f"{key}.lora_up.weight", f"{key}.alpha", f"{key}.diff_b"} <= keys
    assert "diffusion_model.blocks.0.norm3.diff" in keys and not any(k.startswith("transformer.") for k in keys)
    refused = run_here(capsys, "make-random-lora", "wan2.1-t2v-14b", str(tmp_path / "x"), "--tiny", "--layout", "kohya")
    assert refused.returncode != 0 and "layout 'kohya': one of diffusers, wan, lightning" in refused.stderr


def test_ctrl_c_while_the_application_deploys_removes_it(ray_cluster, tmp_path):
    """Ctrl-C at any moment removes what the command deployed: here while its group still starts
    (Serve lists the application DEPLOYING), not only once it serves."""
    from ray import serve
    from support import wait_until

    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [CLI, "serve", "tiny", "--name", "interrupted", "--route-prefix", "/interrupted", "--device", "cpu",
         "--port", str(free_port())],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, "RAY_HSDP_API_KEY": "k"},
    )  # fmt: skip
    try:

        def deploying():
            try:
                app = serve.status().applications.get("interrupted")
            except Exception:  # noqa: BLE001 - no Serve yet: the command starts it
                return False
            return app is not None and app.status == "DEPLOYING"

        wait_until(deploying, 120, "the application deploying", 0.2)
        from ray_hsdp.serve.ingress.routes import serve_http_options

        host, port = serve_http_options()  # the address Serve listens on, which the command prints
        wait_until(lambda: f"at http://{host}:{port}/interrupted" in log.read_text(), 30, "the address printed")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        assert "interrupted" not in serve.status().applications
        output = log.read_text()
        assert "removing application 'interrupted'" in output and "Traceback" not in output, output[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
