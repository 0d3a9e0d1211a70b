"""The bundle manifest: the only contract between export time and run time.

A bundle is a directory holding manifest.json, the model files it names (each with its sha256),
tokenizer.json and tokenizer_meta.json. The runtime refuses a bundle whose format version it does
not know or whose files do not match their hashes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mtp_edge import __version__
from mtp_edge.errors import UserError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TARGETS = {"android": "executorch", "coreml": "coreml", "onnx": "onnxruntime"}


@dataclass
class ModelFile:
    file: str  # relative to the bundle directory
    sha256: str
    quant: dict  # scheme, group size, embedding scheme
    methods: dict  # method name -> {"inputs": [...], "outputs": [...]} (names, shapes, dtypes)


@dataclass
class Manifest:
    target: str  # android | coreml | onnx
    backend: str  # executorch | coreml | onnxruntime
    model_name: str
    max_seq_len: int
    max_chunk: int  # most tokens one target call takes (prefill chunk)
    vocab_size: int
    bos_id: int | None
    eos_ids: list[int]
    chat_template: str | None
    models: dict[str, ModelFile]  # "target", and "drafter" when the drafter has a model
    drafter: dict  # {"kind": none|ngram|mtp|draft-lm, "k": int, ...settings}
    quality: dict = field(default_factory=dict)
    # The chat template rendered around one user message, {"prefix", "suffix"}: how a runtime
    # without jinja (the native C++ core) forms a chat prompt. None: no template, or old bundle.
    chat_format: dict | None = None
    format_version: int = FORMAT_VERSION
    exporter_version: str = __version__

    def save(self, directory: Path) -> None:
        (directory / MANIFEST).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path, verify: bool = True) -> Manifest:
        directory = Path(directory)
        path = directory / MANIFEST
        if not directory.is_dir():
            raise UserError(f"bundle {directory} does not exist: export one with mtp-export")
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"{directory} is not a bundle: it has no {MANIFEST}") from None
        except ValueError as e:
            raise UserError(f"{path} is not valid JSON ({e}): re-export the bundle") from None
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise UserError(
                f"bundle {directory} has format version {version}, this runtime reads "
                f"{FORMAT_VERSION}: re-export it with this version of mtp-export"
            )
        try:
            data["models"] = {k: ModelFile(**v) for k, v in data["models"].items()}
            manifest = cls(**data)
        except TypeError as e:
            raise UserError(f"{path} does not match the manifest schema ({e})") from None
        if verify:
            for entry in manifest.models.values():
                file = directory / entry.file
                if not file.exists():
                    raise UserError(f"bundle {directory} is missing {entry.file}: re-export it")
                if sha256(file) != entry.sha256:
                    raise UserError(
                        f"bundle {directory}: {entry.file} does not match its sha256 in "
                        f"{MANIFEST} (modified or corrupted): re-export the bundle"
                    )
        return manifest


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
