"""Keeping the terminal for our own progress, results and errors.

Three levels, set once by the command line (`set_verbosity`): quiet (results and errors only),
normal (progress lines and bars; the known chatter of third-party libraries dropped) and verbose
(progress, and everything the libraries print). Progress always goes to stderr, so that stdout
carries only results. Stages report through `say` (one line) and `progress_bar` (counted work)
or `estimated_stage` (work that reports nothing until it is done).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

_level = {"quiet": False, "verbose": False}

# A bar on a terminal redraws in place this often; elsewhere (CI logs, pipes) a redraw would be
# one more line, so it prints a plain line at most this often, plus its first and last.
TERMINAL_REDRAW_S = 0.1
PLAIN_LINE_EVERY_S = 30.0

# Lines that third-party code prints on stderr which say nothing a user can act on. Each pattern
# names the library's file or message exactly, so that their warnings and errors, and anything
# unknown, still come through.
NOISE = [
    re.compile(p)
    for p in (
        # ExecuTorch's CPU probing, at every program load
        r"\[cpuinfo_utils\.cpp:\d+\] (Reading file |Failed to open midr file |CPU info and manual)",
        # ExecuTorch's thread pool given another size than its default (--threads N, or a
        # process whose torch keeps fewer threads than the machine has cores)
        r"\[threadpool\.cpp:\d+\] Resetting threadpool to \d+ threads",
        # ExecuTorch's TextLLMRunner (the peer baseline of mtp-bench): its info lines and stats
        r"I tokenizers:regex\.cpp:\d+\] Registering override fallback regex",
        r"\[llm_runner_helper\.cpp:\d+\] (Loaded json tokenizer|Reading metadata|Metadata: |"
        r"Method \S+ not found, using the default value|eos_id = |Using method: )",
        r"\[text_llm_runner\.cpp:\d+\] (RSS after |Max new tokens )",
        r"\[text_prefiller\.cpp:\d+\] Prefill token result numel",
        r"\[text_token_generator\.h:\d+\] *$",  # its line break, then:
        r"^Reached to the end of generation$",
        r"\[stats\.h:\d+\] ",
        # torchao's optional CUDA kernels, absent from CPU wheels
        r"Failed to load \S+/torchao/\S+\.so: Could not load this library",
        # coremltools at import: versions it was not tested with, its macOS-only runtime
        r"scikit-learn version \S+ is not supported\. Minimum required version",
        r"Torch version \S+ has not been tested with coremltools",
        r"Failed to load _ML\w+Proxy: No module named 'coremltools\.libcoremlpython'",
        # torch deprecating what torchao registers
        r"W\d{4} [\d:.]+ +\d+ \S+torch/utils/_pytree\.py:\d+\] <enum '\w+'> is an Enum subclass",
    )
]


def set_verbosity(quiet: bool | None = None, verbose: bool | None = None) -> None:
    """-q: no progress; -v: keep third-party log noise (None: leave as it is). Normal drops
    the noise that passes through Python's warnings and logging."""
    if quiet is not None:
        _level["quiet"] = quiet
    if verbose is not None:
        _level["verbose"] = verbose
        if not verbose:
            quiet_library_noise()


def is_quiet() -> bool:
    return _level["quiet"]


def is_verbose() -> bool:
    return _level["verbose"]


def say(line: str) -> None:
    """One progress line on stderr (above any progress bar); nothing when quiet."""
    if not _level["quiet"]:
        warn(line)


def warn(line: str) -> None:
    """One line on stderr above any progress bar, also with -q: a warning is not progress."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


class _PlainLines:
    """A progress bar's file when stderr is not a terminal: each redraw ("\\r" + status) becomes
    one line, repeats dropped, so that logs read top to bottom."""

    def __init__(self, stream):
        self.stream = stream
        self.last = ""

    def write(self, text: str) -> None:
        for part in text.split("\r"):
            line = part.rstrip()
            if line and line != self.last:
                self.stream.write(line + "\n")
                self.last = line

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(total: int | None = None, desc: str = "", unit: str = "it", **options):
    """A tqdm bar on stderr with the time left, for counted work (`with progress_bar(n) as bar:
    ... bar.update(k)`); silent when quiet (or `disable`), plain lines when stderr is not a
    terminal."""
    from tqdm import tqdm

    stream = sys.stderr
    terminal = _on_terminal(stream)
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=stream if terminal else _PlainLines(stream),
        disable=_level["quiet"] or options.pop("disable", False),
        mininterval=TERMINAL_REDRAW_S if terminal else PLAIN_LINE_EVERY_S,
        ncols=shutil.get_terminal_size().columns if terminal else None,
        **options,
    )


_terminal_override: list[bool | None] = [None]


def set_terminal(on_terminal: bool | None) -> None:
    """Draw progress as if stderr were (True) or were not (False) a terminal, whatever it is:
    for a child process whose stderr a parent forwards to its own (None: look at stderr)."""
    _terminal_override[0] = on_terminal


def stderr_on_terminal() -> bool:
    """Whether our stderr shows on a terminal (progress bars redraw in place)."""
    return _on_terminal(sys.stderr)


def _on_terminal(stream) -> bool:
    """Whether `stream` shows on a terminal; behind the noise filter, fd 2 is a pipe to it."""
    if _terminal_override[0] is not None and stream in (sys.stderr, sys.__stderr__):
        return _terminal_override[0]
    if _filter and stream is sys.__stderr__:
        return _filter_on_terminal[0]
    return stream.isatty()


@contextmanager
def estimated_stage(desc: str, estimate_s: float, after: str = "still working") -> Iterator[None]:
    """A bar for a stage that reports nothing until it ends: elapsed time against an estimate
    of its duration, full when the stage ends. The estimate is `estimate_s` scaled by how long
    this stage took on this machine before against its estimate then (`learned_factor`). Past
    the estimate the bar does not sit at 99%: it turns into an elapsed-time line that says the
    time left is unknown and what is still going on (`after`)."""
    factor = learned_factor(desc)
    estimate = max(1.0, estimate_s * factor)
    total = max(1, round(estimate))
    form = "{desc}: {percentage:3.0f}%|{bar}| {elapsed} elapsed, ~{remaining} left (estimated)"
    over = (
        "{desc}: {elapsed} elapsed, past the ~" + _clock(estimate) + f" estimate; {after}, "
        "time left unknown"
    )
    bar = progress_bar(total, desc, unit="s", bar_format=form)
    done = threading.Event()
    started = time.monotonic()

    past = threading.Event()  # the estimate ran out: no percentage, no time left

    def tick() -> None:
        shown = started
        while not done.wait(0.5):
            elapsed = time.monotonic() - started
            if not past.is_set() and elapsed < total * 0.95:
                bar.update(elapsed - bar.n)
            elif time.monotonic() - shown >= bar.mininterval:
                past.set()
                bar.bar_format = over
                bar.refresh()
                shown = time.monotonic()

    ticker = threading.Thread(target=tick, daemon=True)
    if not bar.disable:
        ticker.start()
    try:
        yield
        done.set()
        if ticker.is_alive():
            ticker.join()
        seconds = time.monotonic() - started
        if past.is_set():
            bar.bar_format = "{desc}: done in {elapsed}"
        bar.update(total - bar.n)
        remember_duration(desc, seconds, estimate_s)
    finally:
        done.set()
        bar.close()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes:02d}:{secs:02d}"


# How long estimated stages took on this machine against their estimates: each stage's factor
# (measured / estimated seconds, smoothed over runs) scales its next estimate.
_DURATIONS_FILE = "stage_durations.json"


def _durations_path():
    from pathlib import Path

    base = os.environ.get("XDG_CACHE_HOME") or (
        str(Path.home() / ".cache") if os.environ.get("HOME") else None
    )
    return None if base is None else Path(base) / "mtp-edge" / _DURATIONS_FILE


def learned_factor(desc: str) -> float:
    """This machine's measured / estimated time for stage `desc`, 1.0 when never measured."""
    import json

    path = _durations_path()
    try:
        factor = float(json.loads(path.read_text())[desc])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 1.0
    return min(max(factor, 0.05), 50.0) if factor == factor else 1.0


def remember_duration(desc: str, seconds: float, estimate_s: float) -> None:
    """Fold a stage's measured time into its factor (the geometric mean of the last factor and
    this run's, so that one odd run moves it half way). A read-only cache costs only this."""
    import json
    import math

    path = _durations_path()
    if path is None or estimate_s <= 0 or seconds < 1.0:  # too short to say anything
        return
    try:
        known = json.loads(path.read_text())
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    ratio = seconds / estimate_s
    old = known.get(desc)
    if isinstance(old, (int, float)) and old > 0:
        ratio = math.sqrt(old * ratio)
    known[desc] = round(ratio, 4)
    try:
        from mtp_edge.files import write_atomic

        write_atomic(path, json.dumps(known, indent=1, sort_keys=True) + "\n")
    except OSError:
        pass


def quiet_library_noise() -> None:
    """torch/torchao/ExecuTorch deprecation notes and optional-kernel load failures, when they
    pass through Python's warnings and logging."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*[Mm]utation on a buffer.*")
    for name in ("torchao", "torch.utils._pytree", "torch._export", "executorch"):
        logging.getLogger(name).setLevel(logging.ERROR)


def is_noise(line: str) -> bool:
    return any(pattern.match(line.lstrip("\r")) for pattern in NOISE)


_filter: list = []
_filter_on_terminal = [False]


def filter_stderr_noise() -> None:
    """Route file descriptor 2 through a small filter process that drops `NOISE` lines and
    passes everything else unchanged: C++ libraries write to the descriptor directly, past any
    Python-level filter. A separate process, not a thread, so that whatever a crash writes last
    still reaches the terminal. Only for a real stderr (not a test's captured one), once."""
    if _filter:
        return
    try:
        if sys.stderr.fileno() != 2:
            return
    except (AttributeError, ValueError, OSError):
        return
    sys.stderr.flush()
    _filter_on_terminal[0] = os.isatty(2)
    terminal = os.dup(2)
    child = subprocess.Popen(
        [sys.executable, "-c", "from mtp_edge.logs import run_filter; run_filter()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    os.dup2(child.stdin.fileno(), 2)
    child.stdin.close()
    _filter.append(child)
    atexit.register(_stop_filter, child, terminal)


def _stop_filter(child: subprocess.Popen, terminal: int) -> None:
    """Give fd 2 back to the terminal, so the filter reads to the end and exits, and wait for it:
    the shell's prompt comes after our last line."""
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os.dup2(terminal, 2)
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:  # a worker still holds the pipe; it ends with it
        pass


# How long a line without its end may wait for the rest before it is judged and passed on
# (a progress bar redraws with "\r" and no newline).
PARTIAL_WAIT_S = 0.05


def run_filter(source: int = 0, sink: int = 2) -> None:
    """The filter process: copy `source` to `sink` line by line, dropping noise lines. It
    outlives signals meant for the command, so that the command's last words get through."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    pending = b""
    passing = False  # the current line's start was already passed on
    held = False  # the current partial line looks like noise: wait for its end
    broken = False

    def put(data: bytes) -> None:
        nonlocal broken
        while data and not broken:
            try:
                data = data[os.write(sink, data) :]
            except OSError:  # the reader went away: keep draining so the command never blocks
                broken = True

    while True:
        wait = PARTIAL_WAIT_S if pending and not held else None
        ready, _, _ = select.select([source], [], [], wait)
        if not ready:
            if passing or not is_noise(pending.decode(errors="replace")):
                put(pending)
                pending, passing = b"", True
            else:
                held = True
            continue
        chunk = os.read(source, 65536)
        if not chunk:
            break
        pending, held = pending + chunk, False
        while b"\n" in pending:
            line, _, pending = pending.partition(b"\n")
            if passing or not is_noise(line.decode(errors="replace")):
                put(line + b"\n")
            passing = False
    if pending and (passing or not is_noise(pending.decode(errors="replace"))):
        put(pending)
