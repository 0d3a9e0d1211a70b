"""Request logs: the requests a deployment serves, kept locally so its heads can learn them.

Written only when asked (`mtp-serve --log DIR`, `mtp-chat --log DIR`, `load(..., log=DIR)`).
Each request is one JSON line in DIR/requests.jsonl:

    {"time": "2026-11-29T08:00:00Z", "model": "...", "messages": [{"role", "content"}...],
     "answer_ids": [...], "finish_reason": "eos", "tau": 2.1}

`messages` is the conversation the request sent (a raw completion prompt is one user message
with "raw": true, and "token_ids" where its text does not encode back to the prompt's ids:
`raw_message`), `answer_ids` the tokens the target answered with, `tau` the tokens per
verification that request got. Nothing else: no client address, no timing beyond the time.

The log is bounded: when requests.jsonl passes `file_bytes` it becomes requests.1.jsonl (the
older files shift up: .1 -> .2 ...) and the oldest beyond `keep` files is deleted, so the folder
never holds more than about (keep + 1) x file_bytes. A line is written whole (a failed write is
taken back) and starts on a line of its own, so a record torn by a writer killed mid-append
spoils only itself: readers skip such lines, and say how many they skipped.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mtp_edge.errors import UserError
from mtp_edge.logs import warn

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
            _append_line(current, line)

    def _rotate(self) -> None:
        if self.keep == 0:
            _rotated(self.directory, 0).unlink(missing_ok=True)
            return
        _rotated(self.directory, self.keep).unlink(missing_ok=True)
        for n in range(self.keep - 1, -1, -1):
            source = _rotated(self.directory, n)
            if source.exists():
                os.replace(source, _rotated(self.directory, n + 1))


def _append_line(path: Path, line: bytes) -> None:
    """Append `line` whole, on a line of its own. A file that does not end with a newline ends
    with a record torn by a writer killed mid-append: the new record starts a new line, or the
    two would make one unreadable line. A write may be short (os.write returns what it wrote):
    the rest follows; a write that fails (a full disk) is taken back, so that no reader meets
    half a record in the middle of the log, and is an error."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        start = os.fstat(fd).st_size
        if start and os.pread(fd, 1, start - 1) != b"\n":
            line = b"\n" + line
        rest = memoryview(line)
        try:
            while rest:
                written = os.write(fd, rest)
                if written <= 0:  # nothing written and no error: it would never end
                    raise OSError(errno.EIO, "the write made no progress")
                rest = rest[written:]
        except OSError as e:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass  # the torn line stays; readers skip it
            raise UserError(
                f"cannot write the request log {path}: {e.strerror or e}: free some space or "
                "give --log another folder"
            ) from None
    finally:
        os.close(fd)


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
        raise UserError(f'{where}: "messages" must be a non-empty list of role/content objects')
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise UserError(f'{where}: every message needs a "role" string')
        if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
            raise UserError(f"{where}: unknown role {m['role']!r} (system, user or assistant)")
        if not isinstance(m.get("content"), str):
            raise UserError(f'{where}: every message needs a "content" string')
        if "token_ids" in m and not _token_ids(m["token_ids"]):
            raise UserError(f'{where}: "token_ids" must be a list of token ids')
    return messages


def _token_ids(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


def raw_message(tokenizer, ids: list[int], text: str | None = None) -> dict:
    """A raw prompt (no chat template) as the log keeps it: one user message marked "raw" whose
    content is `text`, or, for a prompt of token ids, the ids decoded with their special tokens
    (the bos the tokenizer adds by itself left out). Raw text is read back as plain text (see
    `raw_prompt_ids`, and the native runner): where the content does not encode back to `ids`
    (special tokens, which plain text never gives; ids that no text spells; a missing bos), the
    message keeps the ids themselves too, as "token_ids"."""
    ids = [int(i) for i in ids]
    if text is None:
        body = ids[1:] if tokenizer.add_bos and ids[:1] == [tokenizer.bos_id] else ids
        text = tokenizer.backend.decode(body, skip_special_tokens=False)
    message = {"role": "user", "content": text, "raw": True}
    try:
        exact = raw_prompt_ids(tokenizer, message) == ids
    except UserError:
        exact = False
    if not exact:
        message["token_ids"] = ids
    return message


def raw_prompt_ids(tokenizer, message: dict) -> list[int]:
    """A logged raw prompt's ids: its "token_ids" where it has them, else its text encoded as
    raw text is (special tokens written in it as plain text, the tokenizer's bos first)."""
    if "token_ids" in message:
        return list(message["token_ids"])
    return tokenizer.encode_prompt(message["content"], chat=False)


def broken_lines(where: list[str]) -> str:
    """What a reader says of the lines it skipped (their "file:line"s)."""
    n = len(where)
    return (
        f"{n} line{'s' if n > 1 else ''} that {'are' if n > 1 else 'is'} not JSON (cut short "
        f"by a writer killed mid-append; first at {where[0]})"
    )


def read_log(path: str | Path, skipped: list[str] | None = None) -> Iterator[LoggedRequest]:
    """The records of a log file or folder, oldest first. A line that is not JSON (a record
    torn by a writer killed mid-append, wherever it is) is skipped: its "file:line" goes to
    `skipped`, for the caller to report, or without that list, once read to the end, a warning
    line says how many there were. A line that is JSON but not a record is a one-line error
    with its file and line number: no writer makes it, so it is not left out silently."""
    path = Path(path)
    files = log_files(path) if path.is_dir() else [path]
    broken = [] if skipped is None else skipped
    for file in files:
        try:
            # Line by line: a record cut mid-character is one broken line, not a broken file.
            lines = file.read_bytes().split(b"\n")
        except OSError as e:
            raise UserError(f"cannot read the request log {file}: {e.strerror}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{file}:{n}"
            try:
                row = json.loads(line.decode("utf-8"))
            except ValueError:  # UnicodeDecodeError too
                broken.append(where)
                continue
            if not isinstance(row, dict):
                raise UserError(f"{where}: expected a JSON object")
            answer = row.get("answer_ids", [])
            if not isinstance(answer, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in answer
            ):
                raise UserError(f'{where}: "answer_ids" must be a list of token ids')
            tau = row.get("tau")
            yield LoggedRequest(
                check_messages(row.get("messages"), where),
                answer,
                float(tau) if isinstance(tau, int | float) else None,
                where,
            )
    if skipped is None and broken:
        warn(f"warning: the request log {path}: skipped {broken_lines(broken)}")
