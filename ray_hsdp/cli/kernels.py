"""``ray-hsdp build-kernels``: wheels of the fast attention kernels, built for the local GPU.

No wheel of SageAttention 2 or of FlashAttention 3 is on the package index. This builds one from a
local source folder of the public repository, with the flags ``docs/attention.md`` found:

- ``sage``: SageAttention 2 (thu-ml/SageAttention), for the GPU's compute capability.
- ``fa3``: the part of FlashAttention 3 (the ``hopper/`` folder of Dao-AILab/flash-attention) that
  ``attention_backend: fa3_fp8`` runs: forward only, head dim 128, bf16 and e4m3, sm90. Its
  cutlass headers come from the source folder's ``csrc/cutlass`` (the git submodule) or from
  ``--cutlass DIR``.

Everything a build needs is checked before it starts (the source folder, ``nvcc``, a GPU, the CUDA
version the kernel needs for that GPU), and each missing piece is named.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

KERNELS = ("sage", "fa3")

#: FlashAttention 3's features and head dims that fa3_fp8 never runs: left out of the build,
#: which then compiles four files (a build of everything takes hours).
FA3_DISABLED = (
    "BACKWARD SPLIT PAGEDKV APPENDKV LOCAL SOFTCAP PACKGQA FP16 VARLEN CLUSTER HDIM64 HDIM96 "
    "HDIM192 HDIM256 SM80 HDIMDIFF64 HDIMDIFF192"
).split()

#: The oldest CUDA each kernel builds with, by compute capability (SageAttention's and
#: FlashAttention 3's setup.py say the same).
SAGE_MIN_CUDA = {(8, 0): (12, 0), (8, 6): (12, 0), (8, 9): (12, 4), (9, 0): (12, 3), (12, 0): (12, 8)}
FA3_MIN_CUDA = (12, 3)


#: The distribution each kernel's wheel is named after (``NAME-VERSION-...whl``).
WHEEL_NAMES = {"sage": "sageattention", "fa3": "flash_attn_3"}


class BuildRefused(ValueError):
    """The build cannot start here; the message names what is missing."""


class BuildFailed(RuntimeError):
    """The build ran and failed; the message says which, after how long, and where its log is."""


@dataclass
class BuildPlan:
    """What one build runs: the folder ``pip wheel`` builds, its environment, where wheels go."""

    kernel: str
    package_dir: Path
    env: dict[str, str]
    out: Path
    notes: list[str] = field(default_factory=list)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "pip", "wheel", str(self.package_dir), "--no-build-isolation", "--no-deps",
                "-w", str(self.out)]  # fmt: skip


def nvcc_version(nvcc: str) -> tuple[int, int]:
    """``nvcc --version``'s release, as (major, minor)."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"release (\d+)\.(\d+)", out)
    if not found:
        raise BuildRefused(f"could not read the CUDA release from `{nvcc} --version`: {out.strip()[-200:]}")
    return int(found.group(1)), int(found.group(2))


def find_nvcc() -> str:
    """``nvcc`` from ``CUDA_HOME`` or the ``PATH``."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [str(Path(home) / "bin" / "nvcc")] if home else []
    candidates += [shutil.which("nvcc") or "", "/usr/local/cuda/bin/nvcc"]
    for nvcc in candidates:
        if nvcc and Path(nvcc).is_file():
            return nvcc
    raise BuildRefused(
        "no nvcc: the kernels compile with the CUDA toolkit's nvcc (set CUDA_HOME, or put nvcc on the PATH); "
        "build on a GPU host with the toolkit, then ship the wheel to the others"
    )


def gpu_capability() -> tuple[int, int]:
    """The compute capability of this host's first GPU."""
    import torch

    if not torch.cuda.is_available():
        raise BuildRefused(
            "no GPU: the wheel is built for the local GPU's compute capability; run this on a GPU host "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'})"
        )
    return torch.cuda.get_device_capability(0)


def check_toolchain(kernel: str, cuda: tuple[int, int], capability: tuple[int, int]) -> None:
    """Refuses a GPU the kernel does not run on, or a CUDA older than it needs for that GPU."""
    cc = f"{capability[0]}.{capability[1]}"
    if kernel == "fa3":
        if capability != (9, 0):
            raise BuildRefused(f"fa3: FlashAttention 3's FP8 kernel runs on Hopper (compute capability 9.0), not {cc}")
        need = FA3_MIN_CUDA
    else:
        if capability not in SAGE_MIN_CUDA:
            known = ", ".join(f"{a}.{b}" for a, b in SAGE_MIN_CUDA)
            raise BuildRefused(f"sage: SageAttention 2 builds for compute capabilities {known}, not {cc}")
        need = SAGE_MIN_CUDA[capability]
    if cuda < need:
        raise BuildRefused(
            f"{kernel}: CUDA {cuda[0]}.{cuda[1]} is older than the {need[0]}.{need[1]} it needs for compute "
            f"capability {cc}; install a newer CUDA toolkit"
        )


def plan(
    kernel: str, source: Path, out: Path, capability: tuple[int, int], jobs: int, cutlass: Path | None
) -> BuildPlan:
    """The build of ``kernel`` from ``source`` for ``capability``, once the source folder checks out."""
    source = source.resolve()
    env = {"TORCH_CUDA_ARCH_LIST": f"{capability[0]}.{capability[1]}", "MAX_JOBS": str(jobs)}
    if kernel == "sage":
        if not (source / "setup.py").is_file() or not (source / "sageattention").is_dir():
            raise BuildRefused(f"sage: {source} is not a SageAttention source folder (no setup.py and sageattention/)")
        # Four extensions at once, each nvcc on four threads: what docs/attention.md measured.
        env |= {"EXT_PARALLEL": "4", "NVCC_APPEND_FLAGS": "--threads=4"}
        return BuildPlan(kernel, source, env, out.resolve())
    if kernel != "fa3":
        raise BuildRefused(f"unknown kernel {kernel!r}: one of {', '.join(KERNELS)}")
    hopper = source / "hopper"
    if not (hopper / "setup.py").is_file():
        raise BuildRefused(f"fa3: {source} is not a flash-attention source folder (no hopper/setup.py)")
    submodule = source / "csrc" / "cutlass"
    notes = []
    if not (submodule / "include" / "cutlass" / "cutlass.h").is_file():
        if cutlass is None or not (cutlass / "include" / "cutlass" / "cutlass.h").is_file():
            raise BuildRefused(
                f"fa3: no cutlass headers in {submodule} (the git submodule: `git submodule update --init "
                "csrc/cutlass`) and no --cutlass DIR holding include/cutlass/cutlass.h"
            )
        if submodule.exists() and not any(submodule.iterdir()):
            submodule.rmdir()  # the empty folder git leaves for an uninitialised submodule
        submodule.symlink_to(cutlass.resolve(), target_is_directory=True)
        notes.append(f"linked {submodule} -> {cutlass.resolve()}")
    env |= {"FLASH_ATTENTION_FORCE_BUILD": "TRUE"}
    env |= {f"FLASH_ATTENTION_DISABLE_{feature}": "TRUE" for feature in FA3_DISABLED}
    return BuildPlan(kernel, hopper, env, out.resolve(), notes)


def build(kernel: str, source: Path, out: Path, jobs: int | None = None, cutlass: Path | None = None) -> dict:
    """Checks, then builds the wheel; returns its path, the seconds it took and what was built for.

    Raises:
        BuildRefused: What is missing (source, nvcc, GPU, CUDA version), before anything runs.
        BuildFailed: The build itself failed (its log says why).
    """
    if not source.is_dir():
        raise BuildRefused(f"{kernel}: no source folder {source}")
    cuda = nvcc_version(find_nvcc())
    capability = gpu_capability()
    check_toolchain(kernel, cuda, capability)
    build_plan = plan(kernel, source, out, capability, jobs or os.cpu_count() or 4, cutlass)
    wheel, seconds = run_plan(build_plan)
    return {
        "kernel": kernel,
        "wheel": str(wheel),
        "seconds": round(seconds, 1),
        "cuda": f"{cuda[0]}.{cuda[1]}",
        "capability": f"{capability[0]}.{capability[1]}",
        "env": build_plan.env,
        "notes": build_plan.notes,
    }


def run_plan(build_plan: BuildPlan) -> tuple[Path, float]:
    """Runs the build, its output written to ``OUT/KERNEL-build.log``; returns the wheel it wrote
    (the kernel's own, written by this build: a rebuild overwrites a wheel of the same name, and the
    folder may hold other kernels' wheels) and the seconds it took.

    Raises:
        BuildFailed: The build failed, or wrote no wheel of the kernel.
    """
    build_plan.out.mkdir(parents=True, exist_ok=True)
    log = build_plan.out / f"{build_plan.kernel}-build.log"
    started_at, started = time.time(), time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run(
            build_plan.command(), env={**os.environ, **build_plan.env}, stdout=out, stderr=subprocess.STDOUT
        )  # fmt: skip
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise BuildFailed(
            f"{build_plan.kernel}: the build failed after {seconds:.0f} s (exit code {proc.returncode}); its log: {log}"
        )
    name = WHEEL_NAMES[build_plan.kernel]
    # The file system's clock may lag ours by its timestamps' resolution: a second of slack.
    wheels = [w for w in build_plan.out.glob(f"{name}-*.whl") if w.stat().st_mtime >= started_at - 1]
    if not wheels:
        raise BuildFailed(f"{build_plan.kernel}: the build wrote no {name} wheel to {build_plan.out}; its log: {log}")
    return max(wheels, key=lambda w: w.stat().st_mtime), seconds


def shipping(result: dict) -> str:
    """What puts the wheel on every node: a shared folder and pip, or a runtime_env naming it."""
    wheel = Path(result["wheel"])
    backend = "sage" if result["kernel"] == "sage" else "fa3_fp8"
    return "\n".join(
        [
            f"built {wheel.name} in {result['seconds']:.0f} s (CUDA {result['cuda']}, compute capability "
            f"{result['capability']})",
            *result["notes"],
            "",
            "Every node that runs ranks needs it, in the environment `ray start` runs in, with the same Python,",
            "torch and CUDA. Either copy it to a folder every node sees and, on each node:",
            f"    pip install --no-deps {wheel.parent}/{wheel.name}",
            "or name it in the application's runtime_env (Ray installs it in each worker's environment; the",
            "path must exist on every node; --no-deps keeps the node's own torch):",
            "    runtime_env:",
            "      pip:",
            f"        packages: [{wheel.parent}/{wheel.name}]",
            '        pip_install_options: ["--no-deps"]',
            f"Then set attention_backend: {backend} (or --attention-backend {backend}).",
        ]
    )
