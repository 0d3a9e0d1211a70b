"""Request logs: the requests a deployment serves, kept locally so its heads can learn them.

Written only when asked (`mtp-serve --log DIR`, `mtp-chat --log DIR`, `load(..., log=DIR)`).
Each request is one JSON line in DIR/requests.jsonl:

    {"time": "2026-11-29T08:00:00Z", "model": "...", "messages": [{"role", "content"}...],
     "answer_ids": [...], "finish_reason": "eos", "tau": 2.1}

`messages` is the conversation the request sent (a raw completion prompt is one user message
with "raw": true), `answer_ids` the tokens the target answered with, `tau` the tokens per
verification that request got. Nothing else: no client address, no timing beyond the time.

The log is bounded: when requests.jsonl passes `file_bytes` it becomes requests.1.jsonl (the
older files shift up: .1 -> .2 ...) and the oldest beyond `keep` files is deleted, so the folder
never holds more than about (keep + 1) x file_bytes. A line is written with one append, so a
reader never sees half a record, except the last line of a process killed mid-write, which
readers skip.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mtp_edge.errors import UserError

LOG_NAME = "requests.jsonl"
FILE_BYTES = 8 * 1024 * 1024
KEEP = 4


def _rotated(directory: Path, n: int) -> Path:
    return directory / (LOG_NAME if n == 0 else f"requests.{n}.jsonl")


class RequestLog:
    """Appends request records to a bounded, rotated JSONL log in `directory`. Safe to share
    between threads, and between processes writing the same folder (a file lock)."""

    def __init__(self, directory: str | Path, file_bytes: int = FILE_BYTES, keep: int = KEEP):
        if file_bytes < 1024 or keep < 0:
            raise UserError("a request log needs file_bytes >= 1024 and keep >= 0")
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / ".lock"
            probe.touch()
        except OSError as e:
            raise UserError(
                f"cannot write the request log in {directory}: {e.strerror}: "
                "give --log a folder you can write"
            ) from None
        self.file_bytes = file_bytes
        self.keep = keep
        self._lock = threading.Lock()

    def append(
        self,
        messages: list[dict],
        answer_ids: list[int],
        tau: float,
        finish_reason: str = "",
        model: str = "",
    ) -> None:
        record = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model": model,
            "messages": [dict(m) for m in messages],
            "answer_ids": [int(t) for t in answer_ids],
            "finish_reason": finish_reason,
            "tau": round(float(tau), 4),
        }
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        with self._lock, open(self.directory / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            current = _rotated(self.directory, 0)
            size = current.stat().st_size if current.exists() else 0
            if size and size + len(line) > self.file_bytes:
                self._rotate()
            fd = os.open(current, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)

    def _rotate(self) -> None:
        if self.keep == 0:
            _rotated(self.directory, 0).unlink(missing_ok=True)
            return
        _rotated(self.directory, self.keep).unlink(missing_ok=True)
        for n in range(self.keep - 1, -1, -1):
            source = _rotated(self.directory, n)
            if source.exists():
                os.replace(source, _rotated(self.directory, n + 1))


@dataclass
class LoggedRequest:
    messages: list[dict]
    answer_ids: list[int]
    tau: float | None
    where: str  # "file:line", for messages about this record


def log_files(directory: str | Path) -> list[Path]:
    """A log folder's files, oldest first."""
    directory = Path(directory)
    found = []
    for path in directory.glob("requests*.jsonl"):
        middle = path.name[len("requests") : -len(".jsonl")]
        if middle == "":
            found.append((0, path))
        elif middle.startswith(".") and middle[1:].isdigit():
            found.append((int(middle[1:]), path))
    return [p for _, p in sorted(found, reverse=True)]


def check_messages(messages, where: str) -> list[dict]:
    """OpenAI-style messages: a non-empty list of {"role", "content"} with string content."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: \"messages\" must be a non-empty list of role/content objects")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise UserError(f"{where}: every message needs a \"role\" string")
        if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
            raise UserError(f"{where}: unknown role {m['role']!r} (system, user or assistant)")
        if not isinstance(m.get("content"), str):
            raise UserError(f"{where}: every message needs a \"content\" string")
    return messages


def read_log(path: str | Path) -> Iterator[LoggedRequest]:
    """The records of a log file or folder, oldest first. A broken line is a one-line error
    with its file and line number, except a torn last line (a writer killed mid-append)."""
    path = Path(path)
    files = log_files(path) if path.is_dir() else [path]
    for file in files:
        try:
            lines = file.read_text(encoding="utf-8").split("\n")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read the request log {file}: {e}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{file}:{n}"
            try:
                row = json.loads(line)
            except ValueError:
                if n == len(lines):  # no newline after it: torn by a killed writer
                    continue
                raise UserError(f"{where}: not a JSON line") from None
            if not isinstance(row, dict):
                raise UserError(f"{where}: expected a JSON object")
            answer = row.get("answer_ids", [])
            if not isinstance(answer, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in answer
            ):
                raise UserError(f"{where}: \"answer_ids\" must be a list of token ids")
            tau = row.get("tau")
            yield LoggedRequest(
                check_messages(row.get("messages"), where),
                answer,
                float(tau) if isinstance(tau, int | float) else None,
                where,
            )
