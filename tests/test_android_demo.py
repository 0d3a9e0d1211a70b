"""android_demo's JNI bridge, compiled and run on this machine, and the chat C API it calls.

The app itself cannot be built here (no Android SDK, NDK or Google Maven), but its C++ half
can: mtp_jni.cpp is compiled against the JDK's real jni.h and the core's C API, linked with the
host build of the core, loaded into a real JVM (with -Xcheck:jni) and called, through the same
JNI symbols the app's Kotlin `object Native` binds, on a real exported bundle. The chat C API
(a conversation keeping its K/V between turns) is run by the core's test binary on bundles with
an n-gram and an MTP drafter.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny import hf_reference, save_hf_dir, save_random_heads

from mtp_edge.cli import export
from mtp_edge.manifest import Manifest
from mtp_edge.runtime import native
from mtp_edge.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
JNI_SOURCE = ROOT / "android_demo" / "app" / "src" / "main" / "cpp" / "mtp_jni.cpp"
JAVA_SOURCES = [
    Path(__file__).parent / "jni" / "JniCheck.java",
    Path(__file__).parent / "jni" / "ChatCheck.java",
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
    """jni.h, the C API's header and nlohmann/json: the system's, else the pip package's (the
    CMake build's fallback; the [test] extra installs it)."""
    native_dir = ROOT / "runtime" / "native"
    includes = [f"-I{jdk / 'include'}", f"-I{jdk / 'include' / 'linux'}"]
    includes.append(f"-I{native_dir / 'include'}")
    nlohmann = native.nlohmann_include()
    if nlohmann is not None:
        includes.append(f"-idirafter{nlohmann}")  # after the system's, as CMake's fallback
    return includes


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


def _export(root: Path, *drafter: str) -> Path:
    """A tiny random llama with a chat template exported for android."""
    model_dir = save_hf_dir(hf_reference("llama", seed=3), root / "model")
    config = {"bos_token": "<|im_start|>", "add_bos_token": True, "chat_template": TEMPLATE}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    if "mtp" in drafter:  # random heads reading the target's cache: lossless needs no good drafts
        save_random_heads(model_dir, root / "heads.safetensors", "target_cache")
        drafter = (*drafter, "--heads", str(root / "heads.safetensors"))
    out = root / "bundle"
    args = ["--model", str(model_dir), "--out", str(out), "--max-seq-len", "256"]
    args += ["--quality-tokens", "0", "--drafter", *drafter]
    result = CliRunner().invoke(export, args)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """With the n-gram drafter."""
    return _export(tmp_path_factory.mktemp("bundle"), "ngram")


@pytest.fixture(scope="module")
def mtp_bundle(tmp_path_factory) -> Path:
    """With MTP heads that write their K/V into the target's cache (what a kept cache must
    survive)."""
    return _export(tmp_path_factory.mktemp("mtp-bundle"), "mtp")


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


TURNS = ["the cat sat on the mat", "and then? the cat", "hi, hi, hi, hi"]


def _chat_run(bundle_dir: Path) -> dict[str, list[dict]]:
    """tests/test_core.cpp's chat run on the bundle (which checks, in C++, that each answer
    with the cache kept equals the answer after a prefill of the whole conversation): its
    answers by what they were."""
    done = _run([str(native.build(jobs=1).parent / "mtp-native-tests"), "chat", str(bundle_dir)])
    answers: dict[str, list[dict]] = {}
    for line in done.stdout.splitlines():
        row = json.loads(line)
        answers.setdefault(row["what"], []).append(row["result"])
    return answers


@pytest.mark.parametrize("bundle_name", ["bundle", "mtp_bundle"])
def test_chat_keeps_the_cache_between_turns(request, bundle_name):
    bundle_dir = request.getfixturevalue(bundle_name)
    answers = _chat_run(bundle_dir)
    tokenizer = Tokenizer.load(bundle_dir)
    frame = Manifest.load(bundle_dir).chat_format
    assert {"next_turn", "system_prefix", "system_suffix"} <= frame.keys()

    def template_tokens(text: str) -> int:
        """The tokens a later turn adds: the template's frame around the user's text."""
        return len(tokenizer.encode(frame["next_turn"] + text + frame["suffix"]))

    drafter = "mtp+ngram" if bundle_name == "mtp_bundle" else "ngram"  # the bundles' own
    for mode in ("plain", "speculative"):
        turns = answers[mode]
        assert [t["drafter"] for t in turns] == ["none" if mode == "plain" else drafter] * 3
        # The first turn is the prompt the Python runtime forms for the same message.
        assert turns[0]["prompt_tokens"] == len(tokenizer.encode_prompt(TURNS[0]))
        for before, turn, text in zip(turns, turns[1:], TURNS[1:], strict=False):
            answered = before["prompt_tokens"] + len(before["token_ids"])
            # The conversation grows by the answer as generated and the new turn in its frame.
            assert turn["prompt_tokens"] == answered + template_tokens(text)
            # The cache held the conversation up to the answer's last token (fed, if it was
            # not eos, with the new turn): only the new turn's tokens are prefilled.
            assert turn["reused_tokens"] == min(before["cached_tokens"], answered)
            assert turn["reused_tokens"] >= answered - 1
            assert turn["prefilled_tokens"] == turn["prompt_tokens"] - turn["reused_tokens"]
            assert turn["prefilled_tokens"] <= template_tokens(text) + 1
        assert all(t["stats"]["generated_tokens"] == len(t["token_ids"]) > 0 for t in turns)
    assert sum(t["stats"]["accepted_tokens"] for t in answers["speculative"]) > 0

    stopped, after = answers["stopped"][0], answers["after stop"][0]
    assert stopped["stop_reason"] == "stopped" and len(stopped["token_ids"]) == 2
    assert after["reused_tokens"] >= stopped["prompt_tokens"] + 1
    assert answers["after reset"][0]["token_ids"] == answers["plain"][0]["token_ids"]

    full = answers["context full"][0]
    assert full["turns"] >= 1
    assert full["message"].startswith("context full: ")
    assert full["message"].endswith("holds 256: reset the conversation")

    # A system prompt replaces the template's default, as the template renders it.
    system = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": TURNS[0]},
    ]
    expected = tokenizer.encode(tokenizer.apply_chat_template(system))
    if tokenizer.add_bos and expected[:1] != [tokenizer.bos_id]:
        expected.insert(0, tokenizer.bos_id)
    assert answers["system"][0]["prompt_tokens"] == len(expected)


def test_jni_chat(jni_build, jdk, bundle):
    library_dir, classes = jni_build
    java = [str(jdk / "bin" / "java"), "-Xcheck:jni", f"-Djava.library.path={library_dir}"]
    done = _run(java + ["-cp", str(classes), "ChatCheck", str(bundle)], timeout=900)
    assert "WARNING in native method" not in done.stdout + done.stderr, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == 20, done.stdout

    # Two turns, plain then speculative: each turn's answer with the cache kept is the answer
    # after a prefill of the whole conversation, and the second turn prefills only itself.
    for at in (0, 6):
        added1, kept1, whole1, added2, kept2, whole2 = lines[at : at + 6]
        assert added1 is added2 is True
        for kept, whole in ((kept1, whole1), (kept2, whole2)):
            assert kept["result"]["token_ids"] == whole["result"]["token_ids"]
            assert "".join(kept["pieces"]) == kept["result"]["text"]
            assert whole["result"]["reused_tokens"] == 0
        first, second = kept1["result"], kept2["result"]
        assert second["reused_tokens"] >= first["prompt_tokens"] + len(first["token_ids"]) - 1
        assert second["prefilled_tokens"] < second["prompt_tokens"] - first["prompt_tokens"]
    assert lines[1]["result"]["drafter"] == "none" and lines[7]["result"]["drafter"] == "ngram"

    # The stop button: the listener returned false after three pieces.
    stopped, after = lines[12], lines[13]
    assert stopped["result"]["stop_reason"] == "stopped" and len(stopped["pieces"]) == 3
    assert after["result"]["reused_tokens"] >= stopped["result"]["prompt_tokens"] + 2
    assert lines[14] == "java.lang.IllegalStateException: listener stop"
    assert lines[15].startswith("java.lang.RuntimeException: the last user turn has no answer")
    assert lines[16].startswith("java.lang.RuntimeException: there is no user turn to answer")

    # A full context: chatAddUser says false after some turns; a reset starts over.
    assert lines[17] >= 1
    assert lines[18] is True
    assert lines[19]["result"]["token_ids"] == lines[1]["result"]["token_ids"]
