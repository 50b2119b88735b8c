"""What every benchmark records beside its numbers: machine, versions, command."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path


def environment() -> dict:
    import diffusers
    import ray
    import torch
    import transformers

    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {
        "gpus": gpus,
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "ray": ray.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "command": " ".join(sys.argv),
    }


class GpuSampler:
    """nvidia-smi's samples of every GPU's SM clock, power draw and utilisation while open; without
    nvidia-smi (CPU runs) it samples nothing.

    A GPU held at its power limit lowers its clock: two setups that run the same kernels at
    different clocks differ by that much, whatever their code does.

    Args:
        period_ms: Sampling period.
    """

    QUERY = "timestamp,index,clocks.sm,power.draw,utilization.gpu,temperature.gpu"

    def __init__(self, period_ms: int = 200):
        self.period_ms = period_ms
        self._samples: list[tuple[float, int, float, float, float, float]] = []
        self._proc = None
        self._reader = None

    def __enter__(self) -> GpuSampler:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return self
        # Line-buffered: a pipe would otherwise hold seconds of samples back.
        line_buffered = [shutil.which("stdbuf"), "-oL"] if shutil.which("stdbuf") else []
        command = [*line_buffered, exe, f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits"]
        self._proc = subprocess.Popen(
            [*command, f"-lms={self.period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self._samples.append((when, int(parts[1]), *(float(x) for x in parts[2:6])))
            except (ValueError, IndexError):  # a field nvidia-smi reports as [N/A]
                continue

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._reader.join(timeout=10)

    def write_csv(self, path: Path) -> None:
        """Writes every sample (epoch seconds, GPU, SM MHz, W, utilisation %, degrees C), if any."""
        if self._samples:
            rows = ["time_s,gpu,sm_clock_mhz,power_w,util_pct,temperature_c"]
            rows += [",".join(f"{x:.3f}" if i == 0 else f"{x:g}" for i, x in enumerate(s)) for s in self._samples]
            path.write_text("\n".join(rows) + "\n")

    def figures(self, start: float, end: float) -> dict:
        """Means of the samples taken between ``start`` and ``end`` (``time.time()``): SM clock,
        power and utilisation over all GPUs, each GPU's mean clock and its hottest temperature,
        and the mean clock of the slowest GPU; ``{}`` when there are none."""
        window = [s for s in self._samples if start <= s[0] <= end]
        if not window:
            return {}

        def mean(values):
            return round(sum(values) / len(values), 1)

        gpus = sorted({s[1] for s in window})
        per_gpu = [mean([s[2] for s in window if s[1] == gpu]) for gpu in gpus]
        return {
            "sm_clock_mhz": mean([s[2] for s in window]),
            "sm_clock_slowest_gpu_mhz": min(per_gpu),
            "sm_clock_per_gpu_mhz": per_gpu,
            "temperature_max_per_gpu_c": [max(s[5] for s in window if s[1] == gpu) for gpu in gpus],
            "power_w": mean([s[3] for s in window]),
            "gpu_util_pct": mean([s[4] for s in window]),
        }


def write_results(out_dir: Path, name: str, payload: dict, markdown: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2))
    (out_dir / f"{name}.md").write_text(markdown)
    print(markdown)


def failure(err: BaseException, deadline_s: float) -> str:
    """What a failed setup or layout records: the error's class and the last line of its message
    (a rank's traceback ends with its cause); a wait past ``deadline_s`` says so."""
    text = str(err).strip()
    # Pydantic ends its message with a link to its docs: the line before says what was wrong.
    lines = [line for line in text.splitlines() if "errors.pydantic.dev" not in line]
    message = lines[-1].strip() if lines else ""
    if not message and isinstance(err, TimeoutError):
        message = f"no answer within --request-deadline {deadline_s:g} s"
    return f"{type(err).__name__}: {message[:300]}"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def ensure_model(arch: str, model_dir: Path, device: str, small_encoders: bool = False) -> float | None:
    """Writes the random ``arch`` checkpoint to ``model_dir`` unless one is there (real size in bf16
    on cuda, with real-size encoders and VAE unless ``small_encoders``; tiny in fp32 on cpu);
    returns the seconds writing took, ``None`` when nothing was written."""
    import time

    from ray_hsdp.checkpoints.random_weights import make_random

    if (model_dir / "model_index.json").exists():
        return None
    start = time.perf_counter()
    dtype = "bfloat16" if device == "cuda" else "float32"
    make_random(arch, model_dir, dtype=dtype, tiny=device != "cuda", small_encoders=small_encoders)
    return time.perf_counter() - start


def random_loras(arch: str, folder: Path, count: int, rank: int, device: str) -> dict[str, str]:
    """``count`` random rank-``rank`` LoRAs of ``arch`` (real size in bf16 on cuda, tiny in fp32 on
    cpu) under ``folder``, written unless there: name (``lora0``...) -> path, a ``loras`` config."""
    from ray_hsdp.checkpoints.lora import LORA_FILE, make_random_lora

    paths = {}
    for i in range(count):
        path = folder / f"lora{i}"
        if not (path / LORA_FILE).exists():
            dtype = "bfloat16" if device == "cuda" else "float32"
            make_random_lora(arch, path, rank=rank, seed=i, tiny=device != "cuda", dtype=dtype)
        paths[f"lora{i}"] = str(path)
    return paths


def start_ray(ray_cpus: int | None = None, env_vars: dict | None = None, preload: bool = False) -> None:
    """Starts Ray for a benchmark. With ``ray_cpus`` (a CPU dry run) it is a Ray of its own
    ("local") beside any cluster already running here; ``env_vars`` go to every rank; ``preload``:
    its workers import what a rank needs before they take work (``config.RANK_MODULES``)."""
    import ray

    if preload:  # as `ray-hsdp serve` starts its own Ray: Ray's count of idle workers
        from ray_hsdp.config.group import rank_pool_env

        os.environ.update(rank_pool_env(None))

    ray.init(
        address="local" if ray_cpus else None,
        include_dashboard=False,
        log_to_driver=False,
        num_cpus=ray_cpus,
        runtime_env={"env_vars": env_vars} if env_vars else None,
    )


def fox_requests(
    count: int, *, width: int, height: int, frames: int, steps, guidance_scale: float = 5.0, id_prefix: str = "r"
) -> list:
    """``count`` requests of one size, seeds 0..count-1; ``steps`` is a step count or a list that
    the requests take in turn."""
    from ray_hsdp.request import GenerationRequest

    step_list = steps if isinstance(steps, list) else [steps]
    return [
        GenerationRequest(
            prompt=f"a fox {i}",
            width=width,
            height=height,
            num_frames=frames,
            num_inference_steps=step_list[i % len(step_list)],
            guidance_scale=guidance_scale,
            seed=i,
            request_id=f"{id_prefix}{i}",
        )
        for i in range(count)
    ]


def load_plain(model_dir, device: str):
    """Plain diffusers, as a user without ray_hsdp runs it: ``from_pretrained(...).to(device)``."""
    import torch
    from diffusers import DiffusionPipeline

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pipe = DiffusionPipeline.from_pretrained(str(model_dir), torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def speed_up_plain(pipe, compile: bool = False, backend: str | None = None) -> None:
    """What plain diffusers offers a user on its transformers: an attention backend
    (``set_attention_backend``) and regional compile (``compile_repeated_blocks``)."""
    from ray_hsdp.sharding.context_parallel import PROJECT_BACKENDS, set_attention_backend

    for name in ("transformer", "transformer_2"):
        module = getattr(pipe, name, None)
        if module is None:
            continue
        if backend in PROJECT_BACKENDS:  # this project's backend, as the project sets it
            set_attention_backend(module, backend)
        elif backend:  # diffusers' own, as diffusers sets it
            module.set_attention_backend(backend)
        if compile:
            module.compile_repeated_blocks()


def plain_kwargs(request, pipe) -> dict:
    """The arguments plain diffusers' ``pipe`` takes for ``request`` (a ``GenerationRequest``), as
    its model card writes them (``bench.reference.plain_call``)."""
    from bench.reference import plain_call

    return plain_call(pipe, request)


def first_frame_png(width: int, height: int) -> bytes:
    """A synthetic first frame for image-to-video benchmarks (no image files ship with the bench):
    a colour gradient with a disc, as a PNG of ``width`` x ``height``."""
    import io

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    rgb = np.stack([x / width, y / height, 1 - x / width], axis=-1)
    disc = (x - width / 2) ** 2 + (y - height / 2) ** 2 < (min(width, height) / 4) ** 2
    rgb[disc] = (0.9, 0.4, 0.1)
    out = io.BytesIO()
    Image.fromarray((rgb * 255).astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def wait_until(condition, timeout_s: float = 60, what: str = "the condition", interval_s: float = 0.02):
    """Polls ``condition()`` until it returns something truthy, which it returns; fails the test
    with ``what`` once ``timeout_s`` has passed (a regression fails, never hangs a test or a bench)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:g}s")
        time.sleep(interval_s)


def wait_until_healthy(base: str, proc, deadline_s: float = 180, interval_s: float = 1.0) -> None:
    """Polls ``base``/health until it answers 200 with every model ready (``/health`` says ``ok``
    once one model is); kills ``proc`` (the server) and fails if it exits first or the deadline
    passes (Serve retries a failing replica forever: the deadline ends that)."""
    import requests

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            health = requests.get(f"{base}/health", timeout=5)
            if health.status_code == 200 and all(s == "ready" for s in health.json().get("models", {}).values()):
                return
        except requests.RequestException:
            pass
        exited = proc.poll()
        if exited is not None or time.monotonic() > deadline:
            proc.kill()
            why = f"it exited ({exited})" if exited is not None else f"no answer within {deadline_s:g} s"
            raise RuntimeError(f"the server at {base} did not come up: {why}")
        time.sleep(interval_s)


def stop_server(proc) -> None:
    """Stops a ``serve run`` process as Ctrl-C does (it shuts down Serve and the Ray it started),
    killing it if it has not gone within a minute."""
    import signal

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


class ServedYaml:
    """``serve run`` of a copy of a committed YAML whose first application's ``model`` is
    ``model`` and whose other fields are changed by ``overrides`` (``FIELD=VALUE``, as ``ray-hsdp
    serve --set`` reads them), with a fresh API key; ready once ``/health`` answers.

    A context manager: on entry the server is up (``base``, ``key``, ``ready_s``, and ``phases``:
    the group's start phases from ``/v1/pool``), on exit it is stopped."""

    READY_TIMEOUT_S = 1800

    def __init__(self, config_path: Path, model: str, overrides: list[str], out: Path, name: str):
        import os
        import secrets

        import yaml

        from ray_hsdp.cli.serve_flags import parse_value, set_dotted

        config = yaml.safe_load(config_path.read_text())
        args = config["applications"][0]["args"]
        args["model"] = model
        for field in overrides:
            key, _, value = field.partition("=")
            set_dotted(args, key, parse_value(value))
        self.device = args.get("device", "cuda")
        self.key = secrets.token_urlsafe(24)
        self.base = f"http://127.0.0.1:{config['http_options']['port']}"
        out.mkdir(parents=True, exist_ok=True)
        self.served = out / f"{config_path.stem}.served.yaml"
        self.served.write_text(yaml.safe_dump(config))
        self.log_path = out / f"{name}.serve.log"
        self.env = {**os.environ, "RAY_HSDP_API_KEY": self.key}
        self.proc = None

    def __enter__(self) -> ServedYaml:
        import requests

        self._log = open(self.log_path, "w")
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ray.serve.scripts", "run", str(self.served)],  # the `serve` CLI, wherever installed
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        try:
            try:
                wait_until_healthy(self.base, self.proc, self.READY_TIMEOUT_S, interval_s=2)
            except RuntimeError as err:
                raise RuntimeError(f"{err}; see {self.log_path}") from None
            self.ready_s = time.perf_counter() - started
            pool = requests.get(f"{self.base}/v1/pool", headers=self.headers, timeout=60).json()
            self.phases = pool["start"]["phases_s"]
        except BaseException:
            self.__exit__()
            raise
        return self

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}

    def __exit__(self, *exc) -> None:
        stop_server(self.proc)
        self._log.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (for a bench's own server, on a host it has
    to itself)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
