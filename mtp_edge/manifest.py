"""The bundle manifest: the only contract between export time and run time.

A bundle is a directory holding manifest.json, the model files it names (each with its sha256),
tokenizer.json and tokenizer_meta.json. Every key of manifest.json is declared once below, with
its type and meaning; `Manifest.load` checks presence and types and refuses a bad manifest with
one line naming the key. The runtime refuses a bundle whose format version it does not know or
whose files do not match their hashes. The native reader (runtime/native/src/bundle.cpp) reads
the same keys.
"""

from __future__ import annotations

import hashlib
import json
import os
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from mtp_edge.errors import UserError
from mtp_edge.version import __version__

# 2: the platform's key is "platform" (1 called it "target", the word for the verified model).
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
DRAFTER_KINDS = ("none", "ngram", "mtp", "draft-lm")
# The tokenizer's files, entries of `models` like the programs (role -> file name), so that every
# file the runtime reads is hashed; the tokenizer loads them under these names.
TOKENIZER_FILES = {"tokenizer": "tokenizer.json", "tokenizer_meta": "tokenizer_meta.json"}


@dataclass
class ModelFile:
    file: str  # relative to the bundle directory
    sha256: str
    # scheme (str), group_size (int, 0 = per channel), embedding (8w|4w|none), and on ExecuTorch
    # attention (mtp: our row-exact op | executorch: llama.custom_sdpa)
    quant: dict
    # method name -> {"inputs": [...], "outputs": [...]} (names, shapes, dtypes; ONNX adds
    # "in_place" cache pairs and "target_cache" links)
    methods: dict


@dataclass
class DrafterSpec:
    """How the bundle's drafter was exported and how the runtime should run it by default."""

    kind: str = "none"  # none | ngram | mtp | draft-lm
    k: int = 4  # tokens drafted per step (verification width k + 1)
    # The runtime's drafting policy for a model drafter: prompt lookup first where the context's
    # last MIN..MAX tokens occurred before ("MIN-MAX"; None: the model alone) ...
    lookup: str | None = None
    # ... and no draft below this first-token probability.
    draft_confidence: float = 0.0
    model_name: str | None = None  # draft-lm: the draft model's name
    # mtp: the head's reduced vocabulary size and hidden size
    draft_vocab_size: int | None = None
    hidden_size: int | None = None
    # mtp on ExecuTorch: the head runs as this method of the target's program, on its cache
    method: str | None = None
    reads_target_cache: bool = False  # the head attends to the target's last-layer cache
    own_cache: bool = False  # a self (EAGLE) head with a cache of its own, fed verified rows
    max_chunk: int = 0  # own_cache: most rows one call of the head's program takes
    # mtp: how the heads were trained (mtp-train's summary); after `mtp-export --update-heads`
    # also which heads file the bundle carries ("heads_file", "heads_sha256")
    recipe: dict = field(default_factory=dict)
    functions: dict = field(default_factory=dict)  # coreml: function name -> tokens per call

    def to_json(self) -> dict:
        """Only the keys that say something: what an older reader expects, and what the native
        reader tests for with `contains`."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            if f.name in ("kind", "k") or value != default:
                out[f.name] = value
        return out


@dataclass
class Manifest:
    platform: str  # `mtp-export --target NAME`: a row of mtp_edge/platforms.py
    backend: str  # the backend that runs it (the row's backend)
    model_name: str
    max_seq_len: int  # positions the static cache holds
    max_chunk: int  # most tokens one target call takes (prefill chunk)
    vocab_size: int
    bos_id: int | None
    eos_ids: list[int]
    chat_template: str | None
    models: dict[
        str, ModelFile
    ]  # "target"; "drafter" and "drafter_vocab" when the drafter has them
    drafter: DrafterSpec
    quality: dict = field(default_factory=dict)  # the export's measurements (perplexity, ...)
    # The chat template rendered around one user message, {"prefix", "suffix"}: how a runtime
    # without jinja (the native C++ core) forms a chat prompt. None: no template, or old bundle.
    chat_format: dict | None = None
    # How the export went: {"seconds", "peak_rss_mb", "stages": [{"stage", "seconds",
    # "peak_rss_mb"}]} (logs.StageClock); empty in bundles from before it was recorded.
    export_log: dict = field(default_factory=dict)
    # The checkpoint the target was exported from, {"path", "format": "gguf" | "hf"}: what a
    # peer that reads the original (llama.cpp) decodes. None in bundles from before it was kept.
    source: dict | None = None
    format_version: int = FORMAT_VERSION
    exporter_version: str = __version__

    def to_json(self) -> dict:
        out = asdict(self)
        out["drafter"] = self.drafter.to_json()
        return out

    def save(self, directory: Path) -> None:
        (directory / MANIFEST).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data, where: str) -> Manifest:
        """Check every key's presence and type; `where` names the file in messages."""
        if not isinstance(data, dict):
            raise UserError(
                f"{where} holds {type(data).__name__}, not a manifest object: re-export"
            )
        for key in ("models", "drafter"):
            if key not in data:
                raise UserError(f"{where}: missing key '{key}': re-export the bundle")
        values = _checked(cls, data, where, skip=("models", "drafter"))
        models = data["models"]
        if not isinstance(models, dict) or "target" not in models:
            raise UserError(f"{where}: 'models' must map 'target' (and more) to files: re-export")
        values["models"] = {
            name: ModelFile(**_checked(ModelFile, entry, f"{where}: models.{name}"))
            for name, entry in models.items()
        }
        for name, entry in values["models"].items():
            if not _plain_name(entry.file):
                raise UserError(
                    f"{where}: models.{name}.file '{entry.file}' is not a plain file name inside "
                    "the bundle: re-export the bundle"
                )
        for role, file in TOKENIZER_FILES.items():
            entry = values["models"].get(role)
            if entry is None or entry.file != file:
                raise UserError(
                    f"{where}: no sha256 for {file} (models.{role}; exported by an older "
                    "mtp-export): re-export the bundle"
                )
        values["drafter"] = DrafterSpec(
            **_checked(DrafterSpec, data.get("drafter"), where, "drafter")
        )
        if values["drafter"].kind not in DRAFTER_KINDS:
            raise UserError(
                f"{where}: 'drafter.kind' is '{values['drafter'].kind}', not one of "
                f"{', '.join(DRAFTER_KINDS)}: re-export the bundle"
            )
        return cls(**values)

    @classmethod
    def load(cls, directory: str | Path, verify: bool = True) -> Manifest:
        directory = Path(directory)
        path = directory / MANIFEST
        if directory.is_file():
            raise UserError(
                f"bundle {directory} is a file: give the bundle's directory"
                + (f" ({directory.parent})" if directory.name == MANIFEST else "")
            )
        if not directory.is_dir():
            raise UserError(f"bundle {directory} does not exist: export one with mtp-export")
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"{directory} is not a bundle: it has no {MANIFEST}") from None
        except ValueError as e:
            raise UserError(f"{path} is not valid JSON ({e}): re-export the bundle") from None
        if not isinstance(data, dict):
            raise UserError(
                f"{path} holds {type(data).__name__}, not a manifest object: re-export the bundle"
            )
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise UserError(
                f"bundle {directory} has format version {version}, this runtime reads "
                f"{FORMAT_VERSION}: re-export it with this version of mtp-export"
            )
        manifest = cls.from_json(data, str(path))
        for name, entry in manifest.models.items():
            if (directory / entry.file).is_symlink() and not _inside(directory, entry.file):
                raise UserError(
                    f"{path}: models.{name}.file '{entry.file}' links outside the bundle: "
                    "re-export the bundle"
                )
        if verify:
            verify_files(directory, manifest)
        return manifest


def _plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")


def _inside(directory: Path, name: str) -> bool:
    root = directory.resolve()
    return (directory / name).resolve().is_relative_to(root)


def verify_files(directory: Path, manifest: Manifest) -> None:
    """Every file of the bundle against its sha256 in the manifest. A file whose size and
    modification time match what a previous check recorded for this bundle (the verified-once
    stamp, in the user's cache) is not hashed again: hashing a 1 GB program costs seconds on a
    phone. MTP_EDGE_VERIFY=always hashes every file every time."""
    stamp_path = _stamp_path(directory)
    stamp = {} if os.environ.get("MTP_EDGE_VERIFY") == "always" else _read_stamp(stamp_path)
    seen, changed = {}, False
    for entry in manifest.models.values():
        file = directory / entry.file
        if not file.exists():
            raise UserError(f"bundle {directory} is missing {entry.file}: re-export it")
        stat = file.stat()
        known = stamp.get(entry.file, {})
        if (
            file.is_file()
            and known.get("size") == stat.st_size
            and known.get("mtime_ns") == stat.st_mtime_ns
            and known.get("sha256") == entry.sha256
        ):
            seen[entry.file] = known
            continue
        if sha256(file) != entry.sha256:
            raise UserError(
                f"bundle {directory}: {entry.file} does not match its sha256 in "
                f"{MANIFEST} (modified or corrupted): re-export the bundle"
            )
        changed = True
        if file.is_file():  # a Core ML package (a directory) is hashed every time
            seen[entry.file] = {
                "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns,
                "sha256": entry.sha256,
            }
    if changed and stamp_path is not None:
        _write_stamp(stamp_path, directory, seen)


def _stamp_path(directory: Path) -> Path | None:
    base = os.environ.get("XDG_CACHE_HOME") or (
        str(Path.home() / ".cache") if os.environ.get("HOME") else None
    )
    if base is None:
        return None
    key = hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:32]
    return Path(base) / "mtp-edge" / "verified" / f"{key}.json"


def _read_stamp(path: Path | None) -> dict:
    try:
        files = json.loads(path.read_text())["files"]
        return files if isinstance(files, dict) else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # no stamp, or an unreadable one: hash everything


def _write_stamp(path: Path, directory: Path, files: dict) -> None:
    from mtp_edge.files import write_atomic

    body = {"bundle": str(directory.resolve()), "files": files}
    try:
        write_atomic(path, json.dumps(body, indent=1) + "\n")
    except OSError:
        pass  # a read-only cache only costs the next start a full check


def _checked(cls, data, where: str, section: str | None = None, skip=()) -> dict:
    """The fields of dataclass `cls` from `data`, each present (unless it has a default) and of
    its declared type; anything else is a one-line UserError naming the key."""
    prefix = f"{section}." if section else ""
    if not isinstance(data, dict):
        raise UserError(f"{where}: '{section}' must be an object: re-export the bundle")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(
            f"{where}: unknown key '{prefix}{unknown[0]}' (written by a newer mtp-export?): "
            "re-export the bundle with this version"
        )
    values = {}
    for f in fields(cls):
        if f.name in skip:
            continue
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise UserError(f"{where}: missing key '{prefix}{f.name}': re-export the bundle")
            continue
        value = data[f.name]
        if not _is_a(value, hints[f.name]):
            raise UserError(
                f"{where}: '{prefix}{f.name}' must be {_describe(hints[f.name])}, not "
                f"{json.dumps(value)[:40]}: re-export the bundle"
            )
        values[f.name] = value
    return values


def _is_a(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_is_a(v, item) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return isinstance(value, hint)


def _describe(hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    names = {str: "text", int: "an integer", float: "a number", bool: "true or false"}
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is list:
        item = _describe(typing.get_args(hint)[0])
        return f"a list of {item.removeprefix('an ').removeprefix('a ')}s"
    if typing.get_origin(hint) is dict or hint is dict:
        return "an object"
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def sha256(path: Path) -> str:
    """Of a file, or of a directory (a Core ML .mlpackage): its files' relative paths and bytes."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        if path.is_dir():
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
