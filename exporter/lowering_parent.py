"""The parent's side of the heavy half of an export, which runs in a process of its own: load
(quantizing a part at a time), take the fp32 reference perplexity, lower, write the programs;
then exit.

Lowering a quantized model to XNNPACK leaves memory allocated that nothing in Python holds any
more (measured on Qwen2.5-0.5B: ~1.3 GB after `gc.collect()`), and the quality checks that
follow load the program on top of it. A child process gives all of it back when it exits, so
the export's peak is the larger of the child's and the checks', not their sum.

The parent (`export_in_child`) sends the job as JSON on the child's stdin and reads JSON lines
from a pipe of their own: `{"say": line}` (progress, passed to the parent's `progress`),
`{"result": ...}` or `{"error": message}` (a UserError, raised again in the parent). Whatever
the child prints (progress bars, library output) is forwarded to the parent's stderr, so that
stdout keeps carrying results only. The child runs exporter/lowering_child.py.
"""

from __future__ import annotations

import codecs
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from mtp_edge.errors import UserError
from mtp_edge.exporter.platform import ExportOptions
from mtp_edge.manifest import DrafterSpec, ModelFile


@dataclass
class Lowered:
    """What the child wrote into the bundle directory, and what it measured."""

    models: dict[str, ModelFile]
    drafter: DrafterSpec
    quality: dict  # the fp32 reference perplexity and how it was taken
    stages: list[dict]  # the child's export-log rows, with the parent's memory as `other_mb`


def export_in_child(
    options: ExportOptions,
    directory: Path,
    heldout: list[int],
    max_seq_len: int,
    max_chunk: int,
    progress: Callable[[str], None],
) -> Lowered:
    """Load, quantize and lower `options.model` into `directory` in a child process."""
    from mtp_edge import logs
    from mtp_edge.memory import private_mb

    job = {
        "options": asdict(options),
        "directory": str(directory),
        "heldout": heldout,
        "max_seq_len": max_seq_len,
        "max_chunk": max_chunk,
        "quiet": logs.is_quiet(),
        "verbose": logs.is_verbose(),
        "terminal": logs.stderr_on_terminal(),
    }
    env = dict(os.environ, COLUMNS=str(shutil.get_terminal_size().columns))
    read_fd, write_fd = os.pipe()
    try:
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mtp_edge.exporter.lowering_child",
                str(write_fd),
                str(os.getpid()),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(write_fd,),
            env=env,
        )
    finally:
        os.close(write_fd)
    forwarders = [
        threading.Thread(target=_forward, args=(stream,), daemon=True)
        for stream in (child.stdout, child.stderr)
    ]
    for thread in forwarders:
        thread.start()
    result, error, other_mb = None, None, 0
    try:
        assert child.stdin is not None
        child.stdin.write(json.dumps(job).encode())
        child.stdin.close()
        with os.fdopen(read_fd, encoding="utf-8") as channel:
            for line in channel:
                message = json.loads(line)
                if "say" in message:
                    _on_own_line(progress, message["say"])
                elif "result" in message:
                    result = message["result"]
                    # the parent's own memory while the child still maps the same libraries
                    other_mb = private_mb() or 0
                elif "error" in message:
                    error = message["error"]
        code = child.wait()
    finally:
        if child.poll() is None:  # the parent was interrupted: the child goes too
            child.terminate()
            child.wait()
    for thread in forwarders:
        thread.join(timeout=5)
    if error is not None:
        raise UserError(error)
    if code == -signal.SIGKILL:
        raise UserError(
            "the export's loading and lowering process was killed (SIGKILL), most likely for "
            "lack of memory: free memory, or export with a smaller --max-seq-len or model"
        )
    if code != 0 or result is None:
        raise RuntimeError(
            f"the export's loading and lowering process failed (exit {code}): see above"
        )
    return Lowered(
        models={role: ModelFile(**entry) for role, entry in result["models"].items()},
        drafter=DrafterSpec(**result["drafter"]),
        quality=result["quality"],
        stages=[dict(row, other_mb=other_mb) for row in result["stages"]],
    )


# Whether what was last forwarded to stderr ended its line. A child's progress bar redraws in
# place ("\r" + bar, no newline); a line said meanwhile must not start at the bar's end.
_stderr_lock = threading.Lock()
_line_open = [False]


def _forward(stream) -> None:
    """Copy a child's output to our stderr as it comes (progress bars redraw in place)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while chunk := os.read(stream.fileno(), 65536):
        text = decoder.decode(chunk)
        with _stderr_lock:
            sys.stderr.write(text)
            sys.stderr.flush()
            if text:
                _line_open[0] = not text.endswith("\n")


def _on_own_line(progress: Callable[[str], None], line: str) -> None:
    """Say a child's line on a line of its own: a bar the child is drawing is cleared first (on
    a terminal; it redraws below at its next tick) or ended (elsewhere)."""
    from mtp_edge import logs

    with _stderr_lock:
        if _line_open[0]:
            sys.stderr.write("\r\x1b[K" if logs.stderr_on_terminal() else "\n")
            sys.stderr.flush()
            _line_open[0] = False
        progress(line)
