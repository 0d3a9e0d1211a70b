"""Fixtures shared by the test modules: tiny model directories and tiny bundles, each built once
per run and shared by every module that needs one. Under pytest-xdist the workers share them too:
the first worker to need one builds it under a file lock, the others wait for it and reuse it.

Shared directories are read-only for the tests: a test that edits a bundle edits the copy that
`copy_bundle` gives it. A module whose model must differ (another size, vocabulary or seed that
its assertions rely on) keeps its own fixture."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

# tests/tiny.py is imported as a plain module by the tests.
sys.path.insert(0, os.path.dirname(__file__))

# One compute thread per test process, and per command a test starts (OMP_NUM_THREADS is
# inherited). The README's command runs two test processes on a 2-core machine; with torch's
# default each process's tiny eager steps wake an OpenMP team that spins on the core the other
# process computes on: 600 speculative samples of a 1-layer model took 101 s that way on a
# loaded machine, 3.1 s on one thread. The runtime does the same where it hands the cores to
# a backend (mtp_edge/machine.py claim_cores).
os.environ["OMP_NUM_THREADS"] = "1"
# The int8 path the runtimes see (mtp_edge/machine.py), named rather than read from this CPU's
# flags, so that what the tests expect (a bundle's k, for one: runtime/assemble.py
# k_for_this_cpu) is the same on every CPU: a VNNI path, on which bundles keep their k. The
# tests of the rule name the other paths themselves.
os.environ["MTP_EDGE_INT8_PATH"] = "avx512-vnni"

import torch  # noqa: E402

torch.set_num_threads(1)

from tiny import (  # noqa: E402
    NATIVE_BUILD_LOCK,
    amplify_cache_attention,
    file_lock,
    hf_reference,
    run_shared_dir,
    save_chat_dir,
    save_hf_dir,
    save_random_heads,
)

MTP_KINDS = ("target_cache", "none", "self")


def built_once(factory: pytest.TempPathFactory, name: str, build) -> Path:
    """The directory `name`, made by `build(path)` the first time any test process of this run
    asks for it. A build that fails leaves nothing behind: the next caller builds afresh."""
    root = run_shared_dir(factory, "")
    out, done = root / name, root / f"{name}.done"
    with file_lock(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            try:
                build(out)
            except BaseException:
                shutil.rmtree(out, ignore_errors=True)
                raise
            done.touch()
    return out


def export_cli(*args: str, stderr_to: Path | None = None) -> None:
    """mtp-export in this process with `args`; it must succeed. What it printed on stderr (its
    progress) is kept in `stderr_to`, for the tests of what an export shows."""
    from click.testing import CliRunner

    from mtp_edge.cli import export

    result = CliRunner().invoke(export, [*args])
    assert result.exit_code == 0, result.output
    if stderr_to is not None:
        stderr_to.write_text(result.stderr)


# --- model directories ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random llama (seed 3, 97-token byte-level vocabulary) as a Hugging Face directory:
    safetensors weights, config.json and tokenizer.json, no tokenizer_config.json."""
    return built_once(
        tmp_path_factory, "tiny-llama", lambda out: save_hf_dir(hf_reference("llama", seed=3), out)
    )


@pytest.fixture(scope="session")
def tiny_dir_seed5(tmp_path_factory) -> Path:
    """The same shape with other random weights (seed 5)."""
    return built_once(
        tmp_path_factory,
        "tiny-llama-seed5",
        lambda out: save_hf_dir(hf_reference("llama", seed=5), out),
    )


@pytest.fixture(scope="session")
def chat_tiny_dir(tmp_path_factory) -> Path:
    """tiny_dir's model with a chat template and a bos token (tokenizer_config.json)."""
    return built_once(tmp_path_factory, "tiny-llama-chat", lambda out: save_chat_dir(out, seed=3))


# --- bundles -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def mtp_bundle_of(tmp_path_factory, chat_tiny_dir):
    """kind -> an android (ExecuTorch, the default 8da8w) bundle of chat_tiny_dir with random
    MTP heads of that attention kind (mtp.py: "target_cache", "none" or "self"; lossless needs
    no good drafts), 256 positions and the exporter's default drafting policy. The heads that
    attend have their attention output amplified (tiny.amplify_cache_attention) so that their
    drafts depend on what they read; the self head's program is fp32 (test_native says why).
    The heads file sits beside the bundle: bundle.parent / "heads.safetensors"."""

    def build(kind: str, root: Path) -> None:
        heads = save_random_heads(chat_tiny_dir, _mkdir(root) / "heads.safetensors", kind)
        if kind != "none":
            amplify_cache_attention(heads)
        args = ["--model", str(chat_tiny_dir), "--out", str(root / "bundle")]
        args += ["--max-seq-len", "256", "--quality-tokens", "0"]
        args += ["--drafter", "mtp", "--heads", str(heads)]
        if kind == "self":
            args += ["--draft-quant", "fp32"]
        export_cli(*args)

    def bundle(kind: str) -> Path:
        assert kind in MTP_KINDS, kind
        root = built_once(tmp_path_factory, f"mtp-{kind}", lambda root: build(kind, root))
        return root / "bundle"

    return bundle


@pytest.fixture(scope="session")
def own_int8_bundle(tmp_path_factory, chat_tiny_dir) -> Path:
    """An android bundle of chat_tiny_dir in 8da8w-avx2 (every linear layer, the heads' too, on
    our int8 kernel, mtp_edge::linear_i8) but the target's LM head in 6 bits (--head-quant
    8da6w-avx2, mtp_edge::linear_i6), with random MLP heads, 256 positions and the exporter's
    default drafting policy."""

    def build(root: Path) -> None:
        heads = save_random_heads(chat_tiny_dir, _mkdir(root) / "heads.safetensors", "none")
        args = ["--model", str(chat_tiny_dir), "--out", str(root / "bundle")]
        args += ["--max-seq-len", "256", "--quality-tokens", "0", "--quant", "8da8w-avx2"]
        args += ["--head-quant", "8da6w-avx2"]
        export_cli(*args, "--drafter", "mtp", "--heads", str(heads))

    return built_once(tmp_path_factory, "own-int8", build) / "bundle"


@pytest.fixture(scope="session")
def draft_lm_bundle_256(tmp_path_factory, chat_tiny_dir) -> Path:
    """An android bundle (the default 8da8w) of chat_tiny_dir with a draft model of the same
    vocabulary (the target's own weights, so that drafts are often right: a random draft model
    never is), 256 positions, without a drafting policy (the draft model runs alone, ungated)."""

    def build(root: Path) -> None:
        draft = save_chat_dir(root / "draft", seed=3)
        args = ["--model", str(chat_tiny_dir), "--out", str(root / "bundle")]
        args += ["--max-seq-len", "256", "--quality-tokens", "0", "--drafter", str(draft)]
        export_cli(*args, "--ngram-sizes", "none", "--draft-confidence", "0")

    return built_once(tmp_path_factory, "draft-lm", build) / "bundle"


@pytest.fixture(scope="session")
def ngram_bundle_8da4w(tmp_path_factory, tiny_dir_seed5) -> Path:
    """An android bundle of tiny_dir_seed5 named tiny-8da4w: 8da4w in groups of 32, 96
    positions, the n-gram drafter (no heads ship for a random model), 64 held-out tokens
    measured. What the export printed is beside it: bundle.parent / "export.stderr"."""

    def build(root: Path) -> None:
        out = _mkdir(root) / "tiny-8da4w"
        args = ["--model", str(tiny_dir_seed5), "--out", str(out), "--max-seq-len", "96"]
        args += ["--quality-tokens", "64", "--quant", "8da4w", "--group-size", "32"]
        export_cli(*args, stderr_to=root / "export.stderr")

    return built_once(tmp_path_factory, "ngram-8da4w", build) / "tiny-8da4w"


@pytest.fixture(scope="session")
def ngram_bundle_8da8w(tmp_path_factory, tiny_dir_seed5) -> Path:
    """The same model as an android bundle named tiny-8da8w: 8da8w per channel, 96 positions,
    the n-gram drafter, no quality measurement, exported with -q. What the export printed is
    beside it: bundle.parent / "export.stderr"."""

    def build(root: Path) -> None:
        out = _mkdir(root) / "tiny-8da8w"
        args = ["--model", str(tiny_dir_seed5), "--out", str(out), "--max-seq-len", "96"]
        args += ["--quality-tokens", "0", "--quant", "8da8w", "--group-size", "0", "-q"]
        export_cli(*args, stderr_to=root / "export.stderr")

    return built_once(tmp_path_factory, "ngram-8da8w", build) / "tiny-8da8w"


@pytest.fixture(scope="session")
def onnx_mtp_bundle(tmp_path_factory, tiny_dir) -> Path:
    """An onnx bundle of tiny_dir: fp32 target with hidden-state output, 96 positions, and an
    fp32 drafter graph of random MTP heads without attention (lossless needs no good drafts),
    64 held-out tokens measured. The heads file sits beside it: bundle.parent /
    "heads.safetensors"."""

    def build(root: Path) -> None:
        heads = save_random_heads(tiny_dir, _mkdir(root) / "heads.safetensors", "none")
        args = ["--target", "onnx", "--model", str(tiny_dir), "--out", str(root / "bundle")]
        args += ["--max-seq-len", "96", "--drafter", "mtp", "--heads", str(heads)]
        export_cli(*args, "--quant", "fp32", "--quality-tokens", "64")

    return built_once(tmp_path_factory, "onnx-mtp", build) / "bundle"


@pytest.fixture
def copy_bundle(tmp_path):
    """(bundle, name) -> a fresh copy of a shared bundle, tmp_path / name, to edit or break."""

    def copy(bundle: Path, name: str) -> Path:
        out = tmp_path / name
        shutil.copytree(bundle, out)
        return out

    return copy


# --- the native build ----------------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def ccache_stays_the_users():
    """ccache keeps its cache under XDG_CACHE_HOME, which some tests point at a temporary
    directory (test_native's verified-once stamps): pinned here, before any test moves it, so
    that every native build of the run (host, ARM64, the tests' own) compiles from the user's
    cache rather than into an empty one."""
    if os.environ.get("CCACHE_DIR") or shutil.which("ccache") is None:
        yield
        return
    import subprocess

    found = subprocess.run(["ccache", "-k", "cache_dir"], capture_output=True, text=True)
    if found.returncode != 0 or not found.stdout.strip():
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CCACHE_DIR", found.stdout.strip())
        yield


@pytest.fixture(scope="session", autouse=True)
def one_native_build_at_a_time():
    """mtp_edge.runtime.native_runner.build under NATIVE_BUILD_LOCK for the whole run: test
    modules in other processes (xdist workers) build in the same runtime/native/build."""
    from mtp_edge.runtime import native_runner

    build = native_runner.build

    def locked_build(*args, **kwargs):
        with file_lock(NATIVE_BUILD_LOCK):
            return build(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_runner, "build", locked_build)
        yield


@pytest.fixture(scope="session")
def host_runner() -> Path:
    """The host build of the native runtime (runtime/native/build): mtp-runner's path."""
    from mtp_edge.runtime import native_runner

    return native_runner.build(jobs=1)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
