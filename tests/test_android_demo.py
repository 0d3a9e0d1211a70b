"""android_demo's JNI bridge, compiled and run on this machine.

The app itself cannot be built here (no Android SDK, NDK or Google Maven), but its C++ half
can: mtp_jni.cpp is compiled against the JDK's real jni.h and the core's C API, linked with the
host build of the core, loaded into a real JVM (with -Xcheck:jni) and called, through the same
JNI symbols the app's Kotlin `object Native` binds, on a real exported bundle.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny import hf_reference, save_hf_dir

from mtp_edge.cli import export
from mtp_edge.runtime import native

ROOT = Path(__file__).resolve().parent.parent
JNI_SOURCE = ROOT / "android_demo" / "app" / "src" / "main" / "cpp" / "mtp_jni.cpp"
JAVA_SOURCES = [
    Path(__file__).parent / "jni" / "JniCheck.java",
    Path(__file__).parent / "jni" / "org" / "mtpedge" / "demo" / "Native.java",
]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(["nice", "-n", "19", *command], capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def jdk() -> Path:
    """The JDK whose javac is on PATH (its include/ has jni.h)."""
    javac = shutil.which("javac")
    if javac is None:
        pytest.skip("no JDK: apt-get install -y openjdk-17-jdk-headless")
    home = Path(javac).resolve().parent.parent
    assert (home / "include" / "jni.h").is_file(), f"{home} has no include/jni.h"
    return home


def _includes(jdk: Path) -> list[str]:
    native_dir = ROOT / "runtime" / "native"
    return [f"-I{jdk / 'include'}", f"-I{jdk / 'include' / 'linux'}", f"-I{native_dir / 'include'}"]


def test_jni_compiles_warning_free(jdk, tmp_path):
    _run(
        ["g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-c", str(JNI_SOURCE)]
        + _includes(jdk)
        + ["-o", str(tmp_path / "mtp_jni.o")]
    )


@pytest.fixture(scope="module")
def jni_build(jdk, tmp_path_factory) -> tuple[Path, Path]:
    """libmtp_demo_jni.so linked with the host core, and the compiled Java driver."""
    core_dir = Path(native.build(jobs=1)).parent  # libmtp_edge.so sits beside mtp-runner
    out = tmp_path_factory.mktemp("jni")
    _run(
        ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", str(JNI_SOURCE)]
        + _includes(jdk)
        + [f"-L{core_dir}", "-lmtp_edge", f"-Wl,-rpath,{core_dir}"]
        + ["-o", str(out / "libmtp_demo_jni.so")]
    )
    classes = out / "classes"
    _run([str(jdk / "bin" / "javac"), "-d", str(classes), *map(str, JAVA_SOURCES)])
    return out, classes


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """A tiny random llama exported for android with the n-gram drafter."""
    root = tmp_path_factory.mktemp("bundle")
    model_dir = save_hf_dir(hf_reference("llama", seed=3), root / "model")
    config = {"bos_token": "<|im_start|>", "add_bos_token": True, "chat_template": TEMPLATE}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    out = root / "bundle"
    args = ["--model", str(model_dir), "--out", str(out), "--max-seq-len", "256"]
    args += ["--quality-tokens", "0", "--drafter", "ngram"]
    result = CliRunner().invoke(export, args)
    assert result.exit_code == 0, result.output
    return out


def test_jni_bridge_on_a_bundle(jni_build, jdk, bundle, tmp_path):
    library_dir, classes = jni_build
    prompts = [
        {"id": "a", "category": "chat", "prompt": "the cat sat on the mat. the cat", "k": 1},
        {"id": "b", "category": "code", "prompt": "hi, hi, hi, hi!", "max_new_tokens": 8},
    ]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    java = [str(jdk / "bin" / "java"), "-Xcheck:jni", f"-Djava.library.path={library_dir}"]
    done = _run(
        java + ["-cp", str(classes), "JniCheck", str(bundle), str(prompts_file), "the cat, é 🤗"],
        timeout=900,
    )
    assert "WARNING in native method" not in done.stdout + done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 9, done.stdout

    # Streaming: the pieces the listener got are exactly the reply's text.
    for result_line, pieces_line, drafter in ((0, 1, "none"), (2, 3, "ngram")):
        result, pieces = json.loads(lines[result_line]), json.loads(lines[pieces_line])
        assert result["drafter"] == drafter
        assert "".join(pieces) == result["text"]
        assert result["stats"]["generated_tokens"] == len(result["token_ids"]) > 0
        assert result["stop_reason"] in ("max_tokens", "eos", "context_full")

    # Errors reach Kotlin as exceptions with the core's message; the listener's own exception
    # comes back unchanged.
    assert json.loads(lines[4]) == "java.lang.IllegalStateException: listener stop"
    assert "top_p" in json.loads(lines[5])
    assert "does-not-exist-é" in json.loads(lines[6])

    # The benchmark activity's report: every run, and minibench-style metrics derived from them.
    report = json.loads(lines[7])
    assert int(lines[8]) == 2 * len(prompts)  # one progress line per prompt and repeat
    runs = report["runs"]
    assert [(r["id"], r["repeat"], r["speculative"]) for r in runs] == [
        (p["id"], repeat, speculative)
        for repeat in range(2)
        for p in prompts
        for speculative in (False, True)
    ]
    assert all(
        len(r["result"]["token_ids"]) <= p.get("max_new_tokens", 16)
        for r, p in zip(runs, [p for _ in range(2) for p in prompts for _ in (0, 1)], strict=True)
    )
    metrics = {m["metric"]: m["actualValue"] for m in report["metrics"]}
    assert set(metrics) == {
        "load_status",
        "llm_model_load_time(ms)",
        "plain_token_per_sec",
        "token_per_sec",
        "speedup",
        "tau",
        "acceptance_rate",
        "greedy_identical_fraction",
    }
    pairs = list(zip(runs[::2], runs[1::2], strict=True))
    identical = sum(a["result"]["token_ids"] == b["result"]["token_ids"] for a, b in pairs)
    assert metrics["greedy_identical_fraction"] == identical / len(pairs)
    assert metrics["speedup"] == pytest.approx(
        metrics["token_per_sec"] / metrics["plain_token_per_sec"]
    )
    assert all(m["deviceInfo"] == {"device": "host"} for m in report["metrics"])
