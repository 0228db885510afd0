"""Every C++ kernel builds where the CPU can run it and a compiler is at hand: a kernel that fails to
build falls back to torch's path at run time, which would otherwise turn its tests into skips."""

from __future__ import annotations

import shutil

import pytest

from specctl.kernels import (
    amx_linear,
    cpu,
    decode_attention,
    decode_layer,
    quant_linear,
    skinny_linear,
)


@pytest.mark.parametrize("mod,needs", [(decode_attention, cpu.AVX512_BF16), (skinny_linear, cpu.AVX512_BF16),
                                       (amx_linear, cpu.AMX), (decode_layer, cpu.AMX)],
                         ids=["decode_attention", "skinny_linear", "amx_linear", "decode_layer"])
def test_kernel_builds_where_the_cpu_runs_it(mod, needs):
    missing = [f for f in needs if not cpu.has(f)]
    if missing:
        pytest.skip(cpu.why_not(needs, built=False))
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler here")
    assert mod.load() is not None


@pytest.mark.parametrize("path", quant_linear.PATHS)
def test_quant_linear_builds_where_the_cpu_runs_it(path):
    needs = quant_linear.NEEDS[path]
    if any(not cpu.has(f) for f in needs):
        pytest.skip(cpu.why_not(needs, built=False))
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler here")
    assert quant_linear.load(path) is not None


def test_quantized_block_builds_where_the_cpu_runs_it():
    needs = ("avx512_bf16", "avx512_vnni", "avx512bw", "f16c")
    if any(not cpu.has(f) for f in needs):
        pytest.skip(cpu.why_not(needs, built=False))
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler here")
    assert decode_layer.load_quant() is not None


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    """torch waits forever on the lock an interrupted build left; one older than a build can take goes."""
    import os
    import time

    from specctl.kernels._build import STALE_LOCK_S, clear_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path) and lock.exists()  # a build in progress keeps its lock
    old = time.time() - STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()
    assert "stale build lock" in capsys.readouterr().err
    assert not clear_stale_lock(tmp_path)  # no lock: nothing to do


def test_no_build_exports_the_kernels_functions():
    """Each build keeps its functions to itself (-fvisibility=hidden): exported, the headers' inline
    functions and templates of a later-loaded build bind to the first-loaded build's copies (another ISA's
    code, or another revision's in an A/B)."""
    import subprocess

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm here")
    exts = [decode_attention.load(), skinny_linear.load(), amx_linear.load(), decode_layer.load(),
            decode_layer.load_quant("avx512_vnni"), decode_layer.load_quant("amx_int8"),
            *(quant_linear.load(p) for p in quant_linear.PATHS)]
    exts = [e for e in exts if e is not None]
    if not exts:
        pytest.skip("no kernel builds here")
    for ext in exts:
        out = subprocess.run([nm, "-D", "--defined-only", ext.__file__], capture_output=True, text=True, check=True)
        ours = [line.split()[-1] for line in out.stdout.splitlines() if "7specctl" in line]
        assert not ours, f"{ext.__name__} exports {len(ours)} of its functions, e.g. {ours[0]}"
        assert any("PyInit_" in line for line in out.stdout.splitlines())  # and still its module
