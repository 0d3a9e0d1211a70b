"""android_demo built and run on this machine: its APK without Gradle, its JNI bridge and
Kotlin engine on the host JVM, and the chat C API under them.

- The APK: android_demo/build_apk.py (aapt2, kotlinc against android.jar API 23, dx, zipalign,
  apksigner) builds it from the app's own sources; `apksigner verify` and `aapt dump badging`
  accept it. It has no native libraries (no NDK here).
- The app's non-UI Kotlin (Native.kt, the JNI bindings, and Engine.kt, the engine and chat
  around them) is compiled with kotlinc, with drivers in tests/jni/, and run on the host JVM
  (with -Xcheck:jni) against mtp_jni.cpp compiled with the JDK's real jni.h and linked with the
  host build of the core, on a real exported bundle.
- The chat C API (a conversation keeping its K/V between turns) is run by the core's test
  binary on bundles with an n-gram and an MTP drafter.

The Kotlin and APK tests skip, naming what to install, where the tools are missing
(android_demo/install-build-tools.sh installs them all). Their builds are cached under
~/.cache/mtp-edge, keyed by their inputs' contents, so a rerun costs seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mtp_edge.manifest import Manifest
from mtp_edge.runtime import native_runner
from mtp_edge.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
ANDROID_DEMO = ROOT / "android_demo"
APP_SOURCES = ANDROID_DEMO / "app" / "src" / "main" / "java" / "org" / "mtpedge" / "demo"
JNI_SOURCE = ANDROID_DEMO / "app" / "src" / "main" / "cpp" / "mtp_jni.cpp"
# The app's Kotlin that is not UI: plain Kotlin and org.json, no android.* (checked below).
NON_UI_KOTLIN = [APP_SOURCES / "Native.kt", APP_SOURCES / "Engine.kt"]
DRIVERS = sorted((Path(__file__).parent / "jni").glob("*.kt"))
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtp-edge"
INSTALL_HINT = "or all of them: bash android_demo/install-build-tools.sh"


def _load_build_apk():
    name = "android_demo_build_apk"
    spec = importlib.util.spec_from_file_location(name, ANDROID_DEMO / "build_apk.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


build_apk = _load_build_apk()


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
    nlohmann = native_runner.nlohmann_include()
    if nlohmann is not None:
        includes.append(f"-idirafter{nlohmann}")  # after the system's, as CMake's fallback
    return includes


def _cxx() -> list[str]:
    """g++, through ccache when it is installed (as the native build compiles), with paths
    hashed relative to the repository so that another checkout finds the same entries."""
    ccache = shutil.which("ccache")
    return ["env", f"CCACHE_BASEDIR={ROOT}", ccache, "g++"] if ccache else ["g++"]


def test_jni_compiles_warning_free(jdk, tmp_path):
    _run(
        [*_cxx(), "-std=c++17", "-Wall", "-Wextra", "-Werror", "-c", str(JNI_SOURCE)]
        + _includes(jdk)
        + ["-o", str(tmp_path / "mtp_jni.o")]
    )


@pytest.fixture(scope="module")
def tools():
    return build_apk.find_tools()


def _skip_if_missing(tools, names: tuple[str, ...]) -> None:
    lacking = build_apk.missing(tools, names)
    if lacking:
        pytest.skip("; ".join(lacking) + f" ({INSTALL_HINT})")


def test_non_ui_kotlin_is_plain_kotlin():
    """What the host JVM runs uses no android.* class: the Gradle build and the tests compile
    the same files."""
    for source in NON_UI_KOTLIN:
        text = source.read_text()
        assert text.startswith("package org.mtpedge.demo\n"), source
        imports = re.findall(r"^import\s+(\S+)", text, re.MULTILINE)
        assert not [i for i in imports if i.startswith("android.")], source
        assert not re.search(r"\bandroid\.\w", text.replace("android_demo", "")), source


def _kotlin_classes(tools) -> Path:
    """The app's non-UI Kotlin and the drivers compiled for the host JVM, once per content of
    the sources and version of kotlinc (in the cache)."""
    key = hashlib.sha256()
    for path in [
        *NON_UI_KOTLIN,
        *DRIVERS,
        tools.kotlinc.parent.parent / "build.txt",
        tools.json_jar,
    ]:
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    classes = CACHE / "android-demo-kotlin" / key.hexdigest()[:16]
    if not classes.is_dir():
        partial = classes.with_name(f"{classes.name}.{os.getpid()}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        sources = [*NON_UI_KOTLIN, *DRIVERS]
        command = [str(tools.kotlinc), "-cp", str(tools.json_jar), "-d", str(partial)]
        _run(command + [str(s) for s in sources], timeout=900)
        shutil.rmtree(classes, ignore_errors=True)
        partial.rename(classes)
    return classes


@pytest.fixture(scope="module")
def jni_build(jdk, tools, tmp_path_factory) -> tuple[Path, str]:
    """libmtp_demo_jni.so linked with the host core, and the classpath of the app's non-UI
    Kotlin compiled with the drivers."""
    _skip_if_missing(tools, build_apk.HOST_TOOLS)
    core_dir = Path(native_runner.build(jobs=1)).parent  # libmtp_edge.so sits beside mtp-runner
    out = tmp_path_factory.mktemp("jni")
    _run(
        [*_cxx(), "-std=c++17", "-O1", "-shared", "-fPIC", str(JNI_SOURCE)]
        + _includes(jdk)
        + [f"-L{core_dir}", "-lmtp_edge", f"-Wl,-rpath,{core_dir}"]
        + ["-o", str(out / "libmtp_demo_jni.so")]
    )
    classpath = [_kotlin_classes(tools), tools.kotlin_stdlib, tools.json_jar]
    return out, ":".join(map(str, classpath))


def test_apk_builds_and_verifies(tools):
    """The APK from the app's own sources: signed, accepted by `apksigner verify` and `aapt dump
    badging`, with both activities' classes, the resources and no native library."""
    _skip_if_missing(tools, build_apk.APK_TOOLS)
    out = CACHE / "android-demo-apk"
    done = _run(
        [sys.executable, str(ANDROID_DEMO / "build_apk.py"), "--out", str(out)], timeout=1200
    )
    apk = out / build_apk.APK_NAME
    assert done.stdout.splitlines()[-1].startswith(f"{apk.name} has no native libraries")
    assert "no native libraries" in (out / build_apk.NO_NATIVE_NOTE).read_text()

    signed = _run([tools.apksigner, "verify", "--verbose", str(apk)]).stdout
    assert signed.startswith("Verifies") and "Number of signers: 1" in signed
    badging = _run([tools.aapt, "dump", "badging", str(apk)]).stdout
    config = build_apk.app_config()
    assert f"package: name='{config.application_id}' versionCode='{config.version_code}'" in badging
    assert f"sdkVersion:'{config.min_sdk}'" in badging
    assert f"targetSdkVersion:'{config.target_sdk}'" in badging
    assert f"launchable-activity: name='{config.namespace}.MainActivity'" in badging
    assert "application-label:'mtp-edge'" in badging

    with zipfile.ZipFile(apk) as z:
        names = set(z.namelist())
        dex = z.read("classes.dex")
    assert {"AndroidManifest.xml", "resources.arsc", "classes.dex"} <= names
    assert {"res/layout/activity_main.xml", "res/layout/settings.xml"} <= names
    assert not [n for n in names if n.startswith("lib/")]
    for source in sorted(APP_SOURCES.glob("*.kt")):  # each source's class, and the stdlib's
        assert f"Lorg/mtpedge/demo/{source.stem}".encode() in dex, source.name
    assert b"Lorg/mtpedge/demo/R$layout;" in dex and b"Lkotlin/jvm/internal/Intrinsics;" in dex


def test_apk_build_names_missing_tools(tmp_path):
    """Without the tools on PATH: one line per missing tool naming its package, exit 2, nothing
    written."""
    out = tmp_path / "apk"
    env = {**os.environ, "PATH": str(tmp_path / "empty")}
    command = [sys.executable, str(ANDROID_DEMO / "build_apk.py"), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert all(line.startswith("error: ") for line in lines), done.stderr
    for package in (
        "apt-get install aapt",
        "apt-get install zipalign",
        "apt-get install apksigner",
        "npm install -g kotlin-compiler@",
        "default-jdk-headless",
    ):
        assert sum(package in line for line in lines) >= 1, (package, done.stderr)
    assert lines[-1] == "error: or install them all: sudo bash android_demo/install-build-tools.sh"
    assert not out.exists()
    file = tmp_path / "file"
    file.write_text("")
    done = subprocess.run(command[:-1] + [str(file)], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("error: --out"), done.stderr


@pytest.fixture(scope="module")
def bundle(mtp_bundle_of) -> Path:
    """With MLP heads in a drafter.pte of their own, behind prompt lookup (the exporter's
    default drafting policy): conftest.py's, the same tiny llama and chat template, shared."""
    return mtp_bundle_of("none")


@pytest.fixture(scope="module")
def mtp_bundle(mtp_bundle_of) -> Path:
    """With MTP heads that write their K/V into the target's cache (what a kept cache must
    survive): conftest.py's, the same tiny llama and chat template, shared."""
    return mtp_bundle_of("target_cache")


def own_drafter(bundle: Path) -> str:
    """What both runtimes draft with on `bundle` by default: its drafter, behind prompt lookup
    where its drafting policy has one (runtime/assemble.py, engine.cpp with_bundle_policy)."""
    policy = Manifest.load(bundle).drafter
    return f"{policy.kind}+ngram" if policy.lookup else policy.kind


def test_jni_bridge_on_a_bundle(jni_build, jdk, bundle, tmp_path):
    """The app's Engine (Engine.kt over Native.kt) and the benchmark activity's call."""
    library_dir, classpath = jni_build
    prompts = [
        {"id": "a", "category": "chat", "prompt": "the cat sat on the mat. the cat", "k": 1},
        {"id": "b", "category": "code", "prompt": "hi, hi, hi, hi!", "max_new_tokens": 8},
    ]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    java = [str(jdk / "bin" / "java"), "-Xcheck:jni", f"-Djava.library.path={library_dir}"]
    done = _run(
        java
        + ["-cp", classpath, "org.mtpedge.demo.JniCheck"]
        + [str(bundle), str(prompts_file), "the cat, é 🤗"],
        timeout=900,
    )
    assert "WARNING in native method" not in done.stdout + done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 9, done.stdout

    # Streaming: the pieces the listener got are exactly the reply's text.
    for result_line, pieces_line, drafter in ((0, 1, "none"), (2, 3, own_drafter(bundle))):
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
    unit_tests = native_runner.build(jobs=1).parent / "mtp-native-tests"
    done = _run([str(unit_tests), "chat", str(bundle_dir)])
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

    drafter = own_drafter(bundle_dir)
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


def test_jni_chat(jni_build, jdk, bundle, tmp_path):
    """The app's Chat and Settings (Engine.kt) holding conversations, as the chat screen does,
    and its request log ("remember my requests")."""
    from mtp_edge.request_log import read_log

    library_dir, classpath = jni_build
    java = [str(jdk / "bin" / "java"), "-Xcheck:jni", f"-Djava.library.path={library_dir}"]
    log = tmp_path / "files" / "request-logs" / "bundle"
    done = _run(
        java + ["-cp", classpath, "org.mtpedge.demo.ChatCheck", str(bundle), str(log)],
        timeout=900,
    )
    assert "WARNING in native method" not in done.stdout + done.stderr, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == 25, done.stdout

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
    assert lines[1]["result"]["drafter"] == "none"
    assert lines[7]["result"]["drafter"] == own_drafter(bundle)
    # The app's Settings draft also from the earlier requests (the core's store), which takes in
    # each answered turn: greedy answers stay those of a prefill of the whole conversation.
    assert 0 < lines[7]["result"]["store_requests"] < lines[13]["result"]["store_requests"]

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

    # Remembering: nothing was logged before keepRequestLog; after it, the answered turn, which
    # a restarted engine's store takes in; then nothing more once it stopped.
    opened, remembered, stopped, restarted, refused = lines[20:25]
    assert opened["log"] == str(log) and opened["seeded_requests"] == 0
    records = list(read_log(log))
    assert len(records) == 1
    assert records[0].messages == [{"role": "user", "content": "the cat sat on the mat"}]
    assert records[0].answer_ids == remembered["result"]["token_ids"]
    assert stopped == {"log": None}
    assert restarted["seeded_requests"] == restarted["store_requests"] == 1
    assert refused.startswith("java.lang.RuntimeException: cannot write the request log in ")
