"""``ray-hsdp build-kernels``: everything a build needs is checked before it starts, and named."""

from __future__ import annotations

import pytest

from ray_hsdp.cli.commands import main
from ray_hsdp.cli.kernels import FA3_DISABLED, BuildRefused, check_toolchain, find_nvcc, plan


def sage_source(root):
    (root / "sageattention").mkdir(parents=True)
    (root / "setup.py").write_text("# SageAttention's setup\n")
    return root


def test_build_kernels_stops_at_once_and_names_what_is_missing(tmp_path, capsys):
    assert main(["build-kernels", "sage", "--source", str(tmp_path / "nowhere"), "--out", str(tmp_path / "w")]) == 2
    assert "no source folder" in capsys.readouterr().err
    source = sage_source(tmp_path / "SageAttention")
    assert main(["build-kernels", "sage", "--source", str(source), "--out", str(tmp_path / "w")]) == 2
    # This machine has no GPU; where it has no nvcc either, that is named first.
    try:
        find_nvcc()
        expected = "no GPU"
    except BuildRefused:
        expected = "no nvcc"
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # nothing ran


def test_a_gpu_or_cuda_the_kernel_cannot_build_for_is_refused_with_both_versions():
    with pytest.raises(BuildRefused, match="Hopper.*not 8.0"):
        check_toolchain("fa3", (13, 0), (8, 0))
    with pytest.raises(BuildRefused, match="CUDA 12.2 is older than the 12.3 it needs for compute capability 9.0"):
        check_toolchain("fa3", (12, 2), (9, 0))
    with pytest.raises(BuildRefused, match="CUDA 12.2 is older than the 12.3"):
        check_toolchain("sage", (12, 2), (9, 0))
    with pytest.raises(BuildRefused, match="not 7.5"):
        check_toolchain("sage", (13, 0), (7, 5))
    check_toolchain("sage", (12, 8), (12, 0))
    check_toolchain("fa3", (13, 0), (9, 0))


def test_the_fa3_build_takes_cutlass_from_the_submodule_or_from_cutlass_and_only_the_fp8_forward(tmp_path):
    source = tmp_path / "flash-attention"
    (source / "hopper").mkdir(parents=True)
    (source / "hopper" / "setup.py").write_text("# FlashAttention 3\n")
    (source / "csrc" / "cutlass").mkdir(parents=True)  # an uninitialised submodule: empty
    with pytest.raises(BuildRefused, match="no cutlass headers.*git submodule update --init"):
        plan("fa3", source, tmp_path / "w", (9, 0), 8, None)
    cutlass = tmp_path / "cutlass"
    (cutlass / "include" / "cutlass").mkdir(parents=True)
    (cutlass / "include" / "cutlass" / "cutlass.h").write_text("// cutlass\n")
    build = plan("fa3", source, tmp_path / "w", (9, 0), 8, cutlass)
    assert (source / "csrc" / "cutlass" / "include" / "cutlass" / "cutlass.h").is_file()
    assert build.package_dir == (source / "hopper").resolve()
    assert build.env["TORCH_CUDA_ARCH_LIST"] == "9.0" and build.env["FLASH_ATTENTION_FORCE_BUILD"] == "TRUE"
    assert {f"FLASH_ATTENTION_DISABLE_{feature}" for feature in FA3_DISABLED} <= set(build.env)
    assert "FLASH_ATTENTION_DISABLE_HDIM128" not in build.env  # the head dim fa3_fp8 runs
    command = build.command()
    assert command[-5:] == [
        str(build.package_dir),
        "--no-build-isolation",
        "--no-deps",
        "-w",
        str((tmp_path / "w").resolve()),
    ]
    sage = plan("sage", sage_source(tmp_path / "SageAttention"), tmp_path / "w", (8, 9), 4, None)
    assert sage.env["TORCH_CUDA_ARCH_LIST"] == "8.9" and sage.env["MAX_JOBS"] == "4"


def fake_package(root, name: str, version: str = "1.0"):
    """A source folder pip builds a (pure Python) wheel of the distribution ``name`` from."""
    root.mkdir(parents=True)
    (root / "setup.py").write_text(
        f"from setuptools import setup\nsetup(name={name!r}, version={version!r}, py_modules=[])\n"
    )
    return root


def test_a_rebuild_names_its_own_wheel_and_a_failed_build_ends_in_one_line_with_its_log(tmp_path):
    from ray_hsdp.cli.kernels import BuildFailed, BuildPlan, run_plan

    out = tmp_path / "wheels"
    out.mkdir()
    fa3 = fake_package(tmp_path / "hopper", "flash_attn_3")
    first, _ = run_plan(BuildPlan("fa3", fa3, {}, out))
    assert first.name.startswith("flash_attn_3-1.0-")
    (out / "sageattention-2.2.0-cp311-cp311-linux_x86_64.whl").write_bytes(b"another kernel's wheel")
    again, _ = run_plan(BuildPlan("fa3", fa3, {}, out))  # the same name, overwritten: no new file appears
    assert again == first
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "setup.py").write_text("raise SystemExit('the compiler broke')\n")
    with pytest.raises(BuildFailed) as failed:
        run_plan(BuildPlan("sage", tmp_path / "broken", {}, out))
    message = str(failed.value)
    assert "\n" not in message and "sage: the build failed after" in message
    log = out / "sage-build.log"
    assert f"its log: {log}" in message and "the compiler broke" in log.read_text()
