"""MTP_EDGE_CPU_CLASS=avx2: the kernels of a CPU without AVX-512 or VNNI, on one that has them.

What is checked is which kernels run: the XNNPACK operator an 8da8w linear runs as (ExecuTorch's
event trace names it: QDU8 x QC8W on a VNNI CPU, QD8 x QC8W on an AVX2 one), torch's ATen
vector width, the reported int8 path and the attention version, each in a fresh process, since
the class is set as mtp_edge loads. Their speed is benchmarks' business.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FLAGS = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []

# Runs the int8 probe program (mtp_edge/machine.py: one 8da8w linear lowered to XNNPACK) with
# ExecuTorch's event tracer and prints what ran.
PROBE = textwrap.dedent(
    """
    import json, os, sys, tempfile
    from pathlib import Path
    import mtp_edge
    from mtp_edge import cpu_class
    from mtp_edge.machine import _probe_program, int8_path
    import torch
    from executorch.devtools import Inspector
    from executorch.runtime import Runtime

    cpu_class.check()
    program = Runtime.get().load_program(_probe_program("8da8w"), enable_etdump=True)
    program.load_method("forward").execute([torch.randn(1, 5, 1024)])
    with tempfile.TemporaryDirectory() as tmp:
        program.write_etdump_result_to_file(f"{tmp}/p.etdp", f"{tmp}/d.bin")
        events = Inspector(etdump_path=f"{tmp}/p.etdp").event_blocks
        names = sorted({e.name.split(")")[0] + ")" for b in events for e in b.events
                        if e.name.startswith("Fully Connected")})
    print(json.dumps({
        "gemms": names,
        "aten": torch.backends.cpu.get_cpu_capability(),
        "int8_path": int8_path().name,
        "attention": os.environ.get("MTP_EDGE_ATTENTION_ISA"),
        "applied": cpu_class.applied(),
    }))
    """
)


def run_probe(tmp_path: Path, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MTP_EDGE_")}
    environment.pop("ATEN_CPU_CAPABILITY", None)
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**environment, **env},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif("avx2" not in FLAGS, reason="needs an x86-64 CPU with AVX2")
def test_the_avx2_class_runs_xnnpacks_and_torchs_avx2_kernels(tmp_path):
    emulated = run_probe(tmp_path, MTP_EDGE_CPU_CLASS="avx2")
    assert emulated["applied"] == "avx2"
    assert emulated["gemms"] == ["Fully Connected (NC, QD8, F32, QC8W)"], emulated
    assert emulated["aten"] == "AVX2"
    assert emulated["int8_path"] == "avx2"
    assert emulated["attention"] == "avx2"
    if "avx512_vnni" in FLAGS or "avx_vnni" in FLAGS:  # the class differs from this CPU's own
        own = run_probe(tmp_path)
        assert own["applied"] is None
        assert own["gemms"] == ["Fully Connected (NC, QDU8, F32, QC8W)"], own
        assert own["int8_path"] in ("avx512-vnni", "avx-vnni")
        assert own["attention"] is None


def run_as(cpu_class: str, code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS...` with MTP_EDGE_CPU_CLASS set."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "MTP_EDGE_CPU_CLASS": cpu_class},
        cwd=cwd,
        timeout=300,
    )


def test_an_unknown_class_is_one_line_and_exit_2(tmp_path):
    code = "from mtp_edge.cli import devices; devices()"
    done = run_as("avx3", code, "--json", str(tmp_path / "d.json"), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: MTP_EDGE_CPU_CLASS=avx3 is not a CPU class mtp-edge can run: use one of avx2, "
        "or unset it to run this CPU's own kernels"
    ]
    assert not (tmp_path / "d.json").exists()


@pytest.mark.skipif("avx2" not in FLAGS, reason="needs an x86-64 CPU with AVX2")
def test_the_class_set_after_executorch_loaded_is_refused_before_a_program_runs(tmp_path):
    script = textwrap.dedent(
        """
        import os
        from executorch.extension.pybindings import portable_lib
        os.environ["MTP_EDGE_CPU_CLASS"] = "avx2"
        import mtp_edge
        from mtp_edge.errors import UserError
        from mtp_edge.runtime.executorch_ops import load_kernels
        try:
            load_kernels()
        except UserError as e:
            print(e)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "came too late: ExecuTorch's XNNPACK was loaded before mtp_edge" in done.stdout


def test_the_native_runner_refuses_the_class(tmp_path):
    code = "from mtp_edge.runtime.native_runner import main; main()"
    done = run_as("avx2", code, "--bundle", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 2
    assert "MTP_EDGE_CPU_CLASS runs another CPU class's kernels in the Python runtime only" in (
        done.stderr
    )
