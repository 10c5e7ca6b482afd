"""What the CPU allows (engine/cpu_isa.py): native bfloat16 from the flags, and PPD_CPU_ISA=avx2
standing in for a CPU without AVX-512."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import cpu_isa
from engine.attention import cpu_kernel


def test_native_bfloat16_is_avx512_bf16_or_amx_bf16() -> None:
    avx2_only = {"sse4_2", "avx", "avx2", "fma", "f16c"}  # an EPYC of Zen 2 or 3
    assert not cpu_isa.has_native_bf16(avx2_only)
    assert not cpu_isa.has_native_bf16(
        avx2_only | {"avx512f", "avx512bw", "avx512_vnni"}
    )  # Skylake, Cascade Lake
    assert cpu_isa.has_native_bf16(avx2_only | {"avx512f", "avx512_bf16"})  # Zen 4, Cooper Lake
    assert cpu_isa.has_native_bf16(avx2_only | {"amx_bf16"})
    assert not cpu_isa.has_native_bf16(set())  # a CPU whose flags cannot be read


def test_ppd_cpu_isa_avx2_hides_avx512_and_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """The override hides the flags every decision reads and names the build; a value it does not
    know is an error that lists the choices."""
    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
    native = cpu_isa.cpu_flags()
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    assert cpu_isa.isa() == "avx2"
    hidden = cpu_isa.cpu_flags()
    assert hidden <= native and not any(f.startswith(("avx512", "amx")) for f in hidden)
    assert not cpu_isa.has_native_bf16()
    assert cpu_kernel.ISA_FLAGS["avx2"] == ("-mno-avx512f",)
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match="native, avx2"):
        cpu_isa.isa()


def stand_in_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seconds: float = 0) -> Path:
    """A compiler that records its arguments (in the file returned), takes `seconds` a call and
    writes empty files."""
    cc, calls = tmp_path / "cc", tmp_path / "calls"
    cc.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\nsleep {seconds}\n'
        'while [ $# -gt 1 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n'
    )
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("PPD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
    return calls


def test_the_two_builds_are_two_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On an AVX-512 CPU the AVX2 build lies beside this CPU's in the cache, under its own name,
    built with -mno-avx512f, so that both can be loaded; PPD_CPU_ISA picks it."""
    calls = stand_in_compiler(tmp_path, monkeypatch)
    monkeypatch.setattr(cpu_kernel, "proc_flags", lambda: frozenset({"avx2", "avx512f"}))
    native, avx2 = cpu_kernel.build(), cpu_kernel.build(build_isa="avx2")
    assert native != avx2 and native.exists() and avx2.exists()
    assert avx2.name.startswith("cpu_attention-avx2-") and not native.name.startswith(
        "cpu_attention-avx2-"
    )
    compiled = [line for line in calls.read_text().splitlines() if " -c " in line]
    assert (
        sum("-mno-avx512f" in line for line in compiled)
        == len(compiled) // 2
        == len(cpu_kernel.SOURCES)
    )
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    assert cpu_kernel.build() == avx2


def test_on_an_avx2_cpu_the_avx2_build_is_the_native_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Turning off extensions the CPU lacks changes nothing: one library, compiled once (so also
    without AVX512-BF16 on an AVX-512 CPU that has none)."""
    calls = stand_in_compiler(tmp_path, monkeypatch)
    monkeypatch.setattr(cpu_kernel, "proc_flags", lambda: frozenset({"avx2", "fma"}))
    native = cpu_kernel.build()
    assert cpu_kernel.build(build_isa="avx2") == native
    assert cpu_kernel.build(("-mno-avx512bf16",)) == native
    assert not native.name.startswith("cpu_attention-avx2-")
    compiled = [line for line in calls.read_text().splitlines() if " -c " in line]
    assert len(compiled) == len(cpu_kernel.SOURCES) and not any("-mno-" in c for c in compiled)
    monkeypatch.setattr(cpu_kernel, "proc_flags", lambda: frozenset({"avx2", "avx512f"}))
    no_bf16 = cpu_kernel.build(("-mno-avx512bf16",))
    assert no_bf16 == cpu_kernel.build() != native  # another CPU: its own key
