#!/usr/bin/env python3
"""Builds the demo app's APK without Gradle, from Debian and npm packages.

    python3 android_demo/build_apk.py [--out DIR]     (default: android_demo/build/apk)

Resources (aapt2 compile and link), the Kotlin (kotlinc against android.jar API 23), dex (dx),
pack, zipalign, apksigner with a debug key, then `apksigner verify` and `aapt dump badging`.
It compiles the sources Gradle compiles (app/src/main/{java,kotlin}, the resources and the
manifest) unchanged, with the settings of app/build.gradle.kts (namespace, applicationId,
minSdk, targetSdk, versionCode, versionName). What Gradle's manifest merger does, it does too:
the merged manifest in the build directory gets `package=` (the namespace).

The APK has no native libraries: the NDK (and so libmtp_demo_jni.so, the core and ExecuTorch
for arm64-v8a) is not in any Debian or npm package. It installs and starts; opening a bundle
says the library is missing. A phone build is Gradle's (android_demo/README.md, "Build it").

Tools (android_demo/install-build-tools.sh installs them all): aapt, zipalign, apksigner and a
JDK from Debian; android-sdk-platform-23 and dalvik-exchange from Debian 11 (bullseye);
kotlin-compiler from npm. Steps whose inputs did not change are skipped (a warm build takes
seconds).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

ANDROID_DEMO = Path(__file__).resolve().parent
MAIN = ANDROID_DEMO / "app" / "src" / "main"
GRADLE_SCRIPT = ANDROID_DEMO / "app" / "build.gradle.kts"
DEFAULT_OUT = ANDROID_DEMO / "build" / "apk"
APK_NAME = "mtp-edge-demo-debug.apk"
NO_NATIVE_NOTE = "NO-NATIVE-LIBRARIES.txt"
ANDROID_JAR = Path("/usr/lib/android-sdk/platforms/android-23/android.jar")
JSON_JAR = Path("/usr/share/java/com.android.json.jar")  # org.json, for the host JVM
KOTLIN_COMPILER = "kotlin-compiler@2.4.20"
INSTALLER = "android_demo/install-build-tools.sh"
# Expected seconds per step on a 2-core machine, for the time left before a first build.
FIRST_GUESS = {"kotlinc": 60.0, "dx": 45.0, "javac": 8.0, "sign": 5.0, "verify": 5.0}


@dataclass(frozen=True)
class Tools:
    """Paths of the tools, None where missing."""

    aapt2: str | None
    aapt: str | None
    zipalign: str | None
    apksigner: str | None
    dx: str | None
    javac: str | None
    keytool: str | None
    java: str | None
    kotlinc: Path | None
    android_jar: Path | None
    json_jar: Path | None

    @property
    def kotlin_stdlib(self) -> Path | None:
        return self.kotlinc.parent.parent / "lib" / "kotlin-stdlib.jar" if self.kotlinc else None


def _kotlin_home_ok(home: Path) -> bool:
    """JetBrains' kotlinc 2.x (Debian's kotlin package is 1.3, too old for the sources)."""
    build = home / "build.txt"
    if (
        not (home / "bin" / "kotlinc").is_file()
        or not (home / "lib" / "kotlin-stdlib.jar").is_file()
    ):
        return False
    try:
        return int(build.read_text().strip().split(".")[0]) >= 2
    except (OSError, ValueError):
        return False


def find_kotlinc() -> Path | None:
    """npm's kotlin-compiler (its package puts only kotlinc-js on PATH), else a kotlinc 2.x on
    PATH."""
    homes = []
    npm = shutil.which("npm")
    if npm:
        done = subprocess.run([npm, "root", "-g"], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip():
            homes.append(Path(done.stdout.strip()) / "kotlin-compiler")
    on_path = shutil.which("kotlinc")
    if on_path:
        homes.append(Path(on_path).resolve().parent.parent)
    return next((home / "bin" / "kotlinc" for home in homes if _kotlin_home_ok(home)), None)


def find_tools() -> Tools:
    def existing(path: Path) -> Path | None:
        return path if path.is_file() else None

    return Tools(
        aapt2=shutil.which("aapt2"),
        aapt=shutil.which("aapt"),
        zipalign=shutil.which("zipalign"),
        apksigner=shutil.which("apksigner"),
        dx=shutil.which("dalvik-exchange"),  # Debian names dx so
        javac=shutil.which("javac"),
        keytool=shutil.which("keytool"),
        java=shutil.which("java"),
        kotlinc=find_kotlinc(),
        android_jar=existing(ANDROID_JAR),
        json_jar=existing(JSON_JAR),
    )


BULLSEYE = f"from Debian 11 (bullseye; {INSTALLER} adds its source)"
# What each tool is for, and the package that brings it.
WHERE = {
    "aapt2": "aapt2 (resources): apt-get install aapt",
    "aapt": "aapt (dump badging): apt-get install aapt",
    "zipalign": "zipalign: apt-get install zipalign",
    "apksigner": "apksigner: apt-get install apksigner",
    "dx": f"dx (dex): apt-get install dalvik-exchange {BULLSEYE}",
    "javac": "javac (R.java): apt-get install default-jdk-headless",
    "keytool": "keytool (the debug key): apt-get install default-jdk-headless",
    "java": "java: apt-get install default-jdk-headless",
    "kotlinc": f"kotlinc 2.x: npm install -g {KOTLIN_COMPILER}",
    "android_jar": f"android.jar API 23 ({ANDROID_JAR}): apt-get install "
    f"android-sdk-platform-23 {BULLSEYE}",
    "json_jar": f"org.json for the host JVM ({JSON_JAR}): apt-get install libandroid-json-java",
}
APK_TOOLS = (
    "aapt2",
    "aapt",
    "zipalign",
    "apksigner",
    "dx",
    "javac",
    "keytool",
    "kotlinc",
    "android_jar",
)
HOST_TOOLS = ("java", "kotlinc", "json_jar")  # the app's Kotlin on the host JVM (the tests)


def missing(tools: Tools, names: tuple[str, ...] = APK_TOOLS) -> list[str]:
    """One line per missing tool, naming what installs it."""
    return [f"missing {WHERE[name]}" for name in names if getattr(tools, name) is None]


@dataclass(frozen=True)
class AppConfig:
    """What the build reads from app/build.gradle.kts."""

    namespace: str
    application_id: str
    min_sdk: int
    target_sdk: int
    version_code: int
    version_name: str


def app_config(script: Path = GRADLE_SCRIPT) -> AppConfig:
    text = script.read_text()

    def value(name: str) -> str:
        found = re.search(rf'^\s*{name}\s*=\s*"?([^"\s]+)"?\s*$', text, re.MULTILINE)
        if found is None:
            raise SystemExit(f"error: {script} sets no {name}: the build reads it from there")
        return found.group(1)

    return AppConfig(
        namespace=value("namespace"),
        application_id=value("applicationId"),
        min_sdk=int(value("minSdk")),
        target_sdk=int(value("targetSdk")),
        version_code=int(value("versionCode")),
        version_name=value("versionName"),
    )


def sources() -> list[Path]:
    """What Gradle's main source set compiles: Kotlin and Java under src/main/java and
    src/main/kotlin."""
    roots = [MAIN / "java", MAIN / "kotlin"]
    return sorted(
        path
        for root in roots
        if root.is_dir()
        for path in root.rglob("*")
        if path.suffix in (".kt", ".java")
    )


def _digest(parts: list[str | Path]) -> str:
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            if part.is_dir():
                for file in sorted(p for p in part.rglob("*") if p.is_file()):
                    h.update(str(file.relative_to(part)).encode())
                    h.update(file.read_bytes())
            else:
                h.update(part.read_bytes())
        else:
            h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


class Build:
    """Runs the steps in order; a step whose inputs and command are those of its last run, and
    whose outputs are there, is skipped."""

    def __init__(self, out: Path, steps: list[str]):
        self.out = out
        self.steps = steps
        self.stamps = out / ".stamps"
        self.stamps.mkdir(parents=True, exist_ok=True)
        self.timings_file = out / ".timings.json"
        try:
            self.timings = json.loads(self.timings_file.read_text())
        except (OSError, ValueError):
            self.timings = {}

    def _left(self, index: int) -> float:
        return sum(self.timings.get(s, FIRST_GUESS.get(s, 1.0)) for s in self.steps[index:])

    def step(self, name: str, inputs: list[str | Path], outputs: list[Path], action) -> None:
        index = self.steps.index(name)
        stamp = self.stamps / name
        key = _digest([name, *inputs])
        if all(p.exists() for p in outputs) and stamp.is_file() and stamp.read_text() == key:
            print(f"[{index + 1}/{len(self.steps)}] {name}: up to date", flush=True)
            return
        print(
            f"[{index + 1}/{len(self.steps)}] {name} (about {self._left(index):.0f} s left)",
            flush=True,
        )
        stamp.unlink(missing_ok=True)
        began = time.monotonic()
        action()
        self.timings[name] = round(time.monotonic() - began, 1)
        self.timings_file.write_text(json.dumps(self.timings, indent=1) + "\n")
        stamp.write_text(key)


def run(command: list[str | Path], what: str) -> str:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"error: {what} failed (exit {done.returncode}); its output is above")
    return done.stdout + done.stderr


def _zip_without_versions(source: Path, target: Path) -> None:
    """kotlin-stdlib without META-INF/versions/ (a Java 9 module-info that dx cannot read)."""
    partial = target.with_suffix(".partial")
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            if not info.filename.startswith("META-INF/versions/"):
                z.writestr(info, src.read(info))
    partial.replace(target)


def _keystore(out: Path, tools: Tools) -> Path:
    """The SDK's debug key when there is one (Gradle's debug builds are signed with it, so each
    build installs over the other), else one generated beside the APK."""
    sdk_key = Path.home() / ".android" / "debug.keystore"
    if sdk_key.is_file():
        return sdk_key
    key = out / "debug.keystore"
    if not key.is_file():
        run(
            [
                tools.keytool,
                "-genkeypair",
                "-keystore",
                key,
                "-storepass",
                "android",
                "-keypass",
                "android",
                "-alias",
                "androiddebugkey",
                "-keyalg",
                "RSA",
                "-keysize",
                "2048",
                "-validity",
                "10000",
                "-dname",
                "CN=Android Debug,O=Android,C=US",
            ],
            "keytool (the debug key)",
        )
    return key


STEPS = [
    "aapt2 compile",
    "aapt2 link",
    "javac",
    "kotlinc",
    "dx",
    "pack",
    "zipalign",
    "sign",
    "verify",
]


def build(out: Path, tools: Tools) -> Path:
    """The signed, verified APK; returns its path. One build at a time per directory."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another build in {out}", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        return _build(out, tools)


def _build(out: Path, tools: Tools) -> Path:
    config = app_config()
    src = sources()
    b = Build(out, STEPS)
    res_zip, manifest, linked = out / "res.zip", out / "AndroidManifest.xml", out / "linked.apk"
    gen, r_classes, classes = out / "gen", out / "r-classes", out / "classes"
    stdlib, dex_dir = out / "kotlin-stdlib.jar", out / "dex"
    unsigned, aligned, apk = out / "unsigned.apk", out / "aligned.apk", out / APK_NAME

    b.step(
        "aapt2 compile",
        [MAIN / "res", tools.aapt2],
        [res_zip],
        lambda: run(
            [tools.aapt2, "compile", "--dir", MAIN / "res", "-o", res_zip], "aapt2 compile"
        ),
    )

    def link() -> None:
        # Gradle's manifest merger writes the namespace as package=; the source has none.
        text = (MAIN / "AndroidManifest.xml").read_text()
        manifest.write_text(
            text.replace("<manifest ", f'<manifest package="{config.namespace}" ', 1)
        )
        shutil.rmtree(gen, ignore_errors=True)
        command = [
            tools.aapt2,
            "link",
            "-o",
            linked,
            "-I",
            tools.android_jar,
            "--manifest",
            manifest,
            "--java",
            gen,
            "--min-sdk-version",
            config.min_sdk,
            "--target-sdk-version",
            config.target_sdk,
            "--version-code",
            config.version_code,
            "--version-name",
            config.version_name,
            res_zip,
        ]
        if config.application_id != config.namespace:
            command += ["--rename-manifest-package", config.application_id]
        run([str(c) for c in command], "aapt2 link")

    b.step(
        "aapt2 link",
        [MAIN / "AndroidManifest.xml", res_zip, repr(config), tools.aapt2],
        [linked, gen],
        link,
    )

    def javac() -> None:
        shutil.rmtree(r_classes, ignore_errors=True)
        run(
            [
                tools.javac,
                "--release",
                "8",
                "-nowarn",
                "-cp",
                tools.android_jar,
                "-d",
                r_classes,
                *sorted(gen.rglob("*.java")),
            ],
            "javac (R.java)",
        )

    b.step("javac", [gen, tools.javac], [r_classes], javac)

    def kotlinc() -> None:
        shutil.rmtree(classes, ignore_errors=True)
        kotlin = [p for p in src if p.suffix == ".kt"]
        java = [p for p in src if p.suffix == ".java"]
        # -no-jdk: android.jar is the JDK, as in Gradle's build; bytecode for dx (Java 8).
        classpath = f"{tools.android_jar}:{r_classes}"
        output = run(
            [
                tools.kotlinc,
                "-jvm-target",
                "1.8",
                "-no-jdk",
                "-no-reflect",
                "-cp",
                classpath,
                "-d",
                classes,
                *kotlin,
                *java,
            ],
            "kotlinc",
        )
        if java:
            run(
                [
                    tools.javac,
                    "--release",
                    "8",
                    "-cp",
                    f"{classpath}:{classes}:{tools.kotlin_stdlib}",
                    "-d",
                    classes,
                    *java,
                ],
                "javac (the app's Java)",
            )
        if output.strip():
            print(output.rstrip(), flush=True)

    b.step(
        "kotlinc", [*src, r_classes, tools.kotlinc.parent.parent / "build.txt"], [classes], kotlinc
    )

    def dx() -> None:
        _zip_without_versions(tools.kotlin_stdlib, stdlib)
        shutil.rmtree(dex_dir, ignore_errors=True)
        dex_dir.mkdir()
        run(
            [
                tools.dx,
                "--dex",
                f"--min-sdk-version={config.min_sdk}",
                f"--output={dex_dir / 'classes.dex'}",
                classes,
                r_classes,
                stdlib,
            ],
            "dx",
        )

    b.step("dx", [classes, r_classes, tools.kotlin_stdlib, str(config.min_sdk)], [dex_dir], dx)

    def pack() -> None:
        shutil.copyfile(linked, unsigned)
        with zipfile.ZipFile(unsigned, "a", zipfile.ZIP_DEFLATED) as z:
            for dex in sorted(dex_dir.glob("*.dex")):
                info = zipfile.ZipInfo(dex.name, date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(info, dex.read_bytes())

    b.step("pack", [linked, dex_dir], [unsigned], pack)
    b.step(
        "zipalign",
        [unsigned],
        [aligned],
        lambda: run([tools.zipalign, "-f", "-p", "4", unsigned, aligned], "zipalign"),
    )
    key = _keystore(out, tools)

    def sign() -> None:
        partial = out / (APK_NAME + ".partial")
        run(
            [
                tools.apksigner,
                "sign",
                "--ks",
                key,
                "--ks-pass",
                "pass:android",
                "--key-pass",
                "pass:android",
                "--ks-key-alias",
                "androiddebugkey",
                "--v1-signing-enabled",
                "true",
                "--v2-signing-enabled",
                "true",
                "--v3-signing-enabled",
                "true",
                "--out",
                partial,
                aligned,
            ],
            "apksigner sign",
        )
        partial.replace(apk)
        Path(str(partial) + ".idsig").unlink(missing_ok=True)

    b.step("sign", [aligned, key], [apk], sign)
    b.step("verify", [apk], [apk], lambda: verify(apk, tools, config))
    (out / NO_NATIVE_NOTE).write_text(
        f"{APK_NAME} has no native libraries (no lib/arm64-v8a/): libmtp_demo_jni.so, the core\n"
        "and ExecuTorch for arm64-v8a need the Android NDK, which no Debian or npm package has.\n"
        "It installs and starts; opening a bundle says the library is missing. For a phone, build\n"
        'with Gradle and the NDK: android_demo/README.md, "Build it".\n'
    )
    return apk


def verify(apk: Path, tools: Tools, config: AppConfig) -> None:
    """apksigner verify and aapt dump badging accept it, with the launchable activity."""
    signed = run([tools.apksigner, "verify", "--verbose", apk], "apksigner verify")
    if not signed.startswith("Verifies"):
        raise SystemExit(f"error: apksigner verify does not accept {apk}:\n{signed}")
    badging = run([tools.aapt, "dump", "badging", apk], "aapt dump badging")
    wanted = [
        f"package: name='{config.application_id}'",
        f"launchable-activity: name='{config.namespace}.MainActivity'",
    ]
    lacking = [line for line in wanted if line not in badging]
    if lacking:
        raise SystemExit(f"error: aapt dump badging of {apk} lacks {lacking}:\n{badging}")
    schemes = [
        line.removeprefix("Verified using ").split(" (")[0]
        for line in signed.splitlines()
        if line.startswith("Verified using") and line.endswith(": true")
    ]
    print(f"  signature verified ({', '.join(schemes)}); aapt dump badging: ok", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build the demo app's APK without Gradle (no native libraries).",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"build directory (default: {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--check", action="store_true", help="only say which tools are missing (exit 2 if any)"
    )
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        print(f"error: --out {args.out} is a file: give a directory", file=sys.stderr)
        return 2
    tools = find_tools()
    lacking = missing(tools)
    if lacking:
        for line in lacking:
            print(f"error: {line}", file=sys.stderr)
        print(f"error: or install them all: sudo bash {INSTALLER}", file=sys.stderr)
        return 2
    if args.check:
        print("every tool is installed")
        return 0
    began = time.monotonic()
    apk = build(args.out, tools)
    size = apk.stat().st_size
    print(f"built {apk} ({size / 1024:.0f} KiB) in {time.monotonic() - began:.0f} s")
    print(
        f"{apk.name} has no native libraries: for a phone, build with Gradle and the NDK "
        f"(android_demo/README.md; {args.out / NO_NATIVE_NOTE})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
