"""The user's requests (`mtp-train --prompts FILE|DIR`): what the heads will draft for.

Accepted, read before any long work (a bad line is a one-line error with its file and line):
- a .txt file: one request per line (blank lines skipped; a literal "\\n" in a line is a newline);
- a .jsonl file: one JSON object per line with a "prompt" string or OpenAI-style "messages"
  ([{"role", "content"}...], the conversation the answer follows);
- a folder: its .txt and .jsonl files, and its request logs (requests.jsonl, requests.1.jsonl...
  as mtp_edge.request_log writes them: records with "messages", "answer_ids", "tau"), oldest
  first. A log's torn records (lines that are not JSON) and empty requests (the server answers
  an empty completion prompt) are skipped, and one warning line counts them.

A request that asks nothing (a raw prompt without text, a blank last user message) in the
user's own files is refused with its file and line.

A request is a plain prompt (str) or a conversation (a tuple of messages); repeats are dropped
(the first kept), so no request sits in both the training and the held-out part.
"""

from __future__ import annotations

import json
from pathlib import Path

from mtp_edge.errors import UserError
from mtp_edge.logs import warn
from mtp_edge.request_log import (
    broken_lines,
    check_messages,
    log_files,
    raw_prompt_ids,
    read_log,
)

# The kind of text the user's requests and their answers are (Sequence.kind): the report's
# "tau on your requests" is measured on the held-out part of it.
YOURS = "your requests"


def _text_file(path: Path) -> list:
    requests = []
    for number, line in enumerate(_lines(path), 1):
        text = line.strip().replace("\\n", "\n")
        if not text:
            continue
        if not text.strip():  # a line of "\\n" only
            raise UserError(f"--prompts {path}:{number}: {EMPTY}")
        if "\x00" in text:
            raise UserError(f"--prompts {path}:{number}: a NUL character; give text requests")
        requests.append(text)
    return requests


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError:
        raise UserError(f"--prompts {path}: not UTF-8 text") from None
    except OSError as e:
        raise UserError(f"cannot read --prompts {path}: {e.strerror}") from None


def _conversation(messages: list[dict], where: str) -> tuple:
    """The messages an answer follows: up to the last user message (a logged or pasted
    conversation may end with the answer it got)."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise UserError(f"--prompts {where}: the messages hold no user message to answer")
    kept = messages[: users[-1] + 1]
    return tuple({k: m[k] for k in ("role", "content", "raw", "token_ids") if k in m} for m in kept)


EMPTY = "the request is empty (no text to answer): give it some text or delete the line"


def _empty(request: tuple) -> bool:
    """Whether a conversation asks nothing: a raw prompt with no text and no ids (raw text may
    be blank, as a completion prompt may), or a blank last user message (which no chat template
    is given: mtp_edge.tokenizer.check_messages)."""
    last = request[-1]
    if len(request) == 1 and last.get("raw"):
        return last["content"] == "" and not last.get("token_ids")
    return not last["content"].strip()


def _jsonl_file(path: Path) -> list:
    requests = []
    for number, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except ValueError:
            raise UserError(
                f'--prompts {where}: not a JSON line (expected {{"prompt": "..."}} or '
                '{"messages": [...]})'
            ) from None
        if not isinstance(entry, dict):
            raise UserError(f"--prompts {where}: expected a JSON object")
        if "messages" in entry:
            try:
                messages = check_messages(entry["messages"], where)
            except UserError as e:
                raise UserError(f"--prompts {e}") from None
            request = _conversation(messages, where)
            if _empty(request):
                raise UserError(f"--prompts {where}: {EMPTY}")
            requests.append(request)
        elif isinstance(entry.get("prompt"), str) and entry["prompt"].strip():
            requests.append(entry["prompt"])
        else:
            raise UserError(
                f'--prompts {where}: expected a non-empty "prompt" string or a "messages" list'
            )
    return requests


def _log_folder(path: Path) -> list:
    """The requests of the folder's logs; torn and empty records are skipped, and said so."""
    requests, broken, empty = [], [], []
    for record in read_log(path, broken):
        request = _conversation(record.messages, record.where)
        if _empty(request):  # the server answers an empty completion prompt: nothing to learn
            empty.append(record.where)
            continue
        requests.append(request)
    skipped = [broken_lines(broken)] if broken else []
    if empty:
        n = len(empty)
        skipped.append(f"{n} empty request{'s' if n > 1 else ''} (first at {empty[0]})")
    if skipped:
        warn(f"warning: --prompts {path}: skipped {' and '.join(skipped)}")
    return requests


def read_prompts(spec: str) -> list:
    """The distinct requests of `spec` (a file or folder, as the module says), in order."""
    path = Path(spec)
    if path.is_dir():
        logs = set(log_files(path))
        files = sorted(
            p for p in path.iterdir() if p.suffix in (".txt", ".jsonl") and p not in logs
        )
        found = _log_folder(path) if logs else []
        for file in files:
            found += _text_file(file) if file.suffix == ".txt" else _jsonl_file(file)
        if not logs and not files:
            raise UserError(
                f"--prompts {spec}: the folder holds no .txt, .jsonl or request-log files"
            )
    elif path.is_file():
        if path.suffix not in (".txt", ".jsonl"):
            raise UserError(
                f"--prompts {spec}: give a .txt file (one request per line), a .jsonl file "
                '("prompt" or "messages" per line) or a folder of them'
            )
        found = _text_file(path) if path.suffix == ".txt" else _jsonl_file(path)
    else:
        raise UserError(f"--prompts {spec}: no such file or folder")
    seen, requests = set(), []
    for request in found:
        key = request if isinstance(request, str) else json.dumps(request, sort_keys=True)
        if key not in seen:
            seen.add(key)
            requests.append(request)
    if not requests:
        raise UserError(f"--prompts {spec}: no requests in it")
    return requests


def request_key(request) -> str:
    """The text a request is cached under (<out>.gen.jsonl's "prompt")."""
    return request if isinstance(request, str) else json.dumps(list(request), ensure_ascii=False)


def encode_request(tokenizer, request) -> list[int]:
    """The request's prompt ids: a plain prompt as one user turn, a conversation through the
    chat template (a logged raw completion, one user message marked "raw", as its "token_ids"
    or else as plain text: mtp_edge.request_log.raw_prompt_ids)."""
    if isinstance(request, str):
        return tokenizer.encode_prompt(request)
    if len(request) == 1 and request[0].get("raw"):
        ids = raw_prompt_ids(tokenizer, request[0])
        vocab = tokenizer.vocab_size
        if not all(0 <= i < vocab for i in ids):
            raise UserError(
                f"its token_ids are not the target's (ids 0..{vocab - 1}): give the requests "
                "of this model, or their text alone"
            )
        if not ids:  # no prompt to answer: generation would start from nothing
            raise UserError("the request encodes to no tokens: give it some text")
        return ids
    if tokenizer.chat_template is None:
        raise UserError(
            'the target has no chat template, so --prompts conversations ("messages") cannot be '
            "rendered: give plain prompts"
        )
    return tokenizer.encode_messages(list(request))
