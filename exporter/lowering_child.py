"""The child process of an export (exporter/lowering_parent.py has the parent's side and the why):
read the job as JSON on stdin (the options as the parent resolved them), load, quantize and lower
into the bundle's directory (exporter/loading.py, which the parent's side imports too), and
report progress and the result as JSON lines on the pipe whose descriptor is the first argument;
the second is the parent's process id: the child leaves as soon as that process is gone.

    python -m mtp_edge.exporter.lowering_child FD PARENT_PID
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from mtp_edge.errors import UserError
from mtp_edge.exporter.platform import ExportOptions


def _lower(job: dict, say: Callable[[str], None]) -> dict:
    """The child's work (`job` as export_in_child writes it); the result's JSON."""
    from mtp_edge.checkpoints import open_checkpoint
    from mtp_edge.exporter.loading import drafter_spec, load_for_export
    from mtp_edge.exporter.platform import platform_module
    from mtp_edge.memory import StageClock, return_freed_memory

    options = ExportOptions(**job["options"])
    platform = platform_module(options.platform)
    clock = StageClock()
    return_freed_memory()
    checkpoint = open_checkpoint(options.model)
    loaded = load_for_export(
        options,
        platform,
        checkpoint,
        job["heldout"],
        job["max_seq_len"],
        job["max_chunk"],
        clock,
        say,
    )
    del checkpoint
    with clock.stage("export"):
        models, settings = platform.export(loaded.job, Path(job["directory"]))
    spec = drafter_spec(options, loaded.job.drafter_kind, loaded.job.draft, settings)
    return {
        "models": {role: asdict(entry) for role, entry in models.items()},
        "drafter": asdict(spec),
        "quality": loaded.quality,
        "stages": clock.rows,
    }


def exit_with_parent(parent: int, every_s: float = 0.5) -> None:
    """Leave (exit 137) once this process is no longer `parent`'s child. A parent killed
    without a chance to stop us (SIGKILL, the OOM killer) would otherwise leave this process
    loading and lowering, gigabytes in use, for nobody. Checked by a daemon thread every
    `every_s` seconds; a reparented process sees another parent id (Linux and macOS alike)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(137)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main(argv: list[str]) -> int:
    from mtp_edge import logs

    if len(argv) > 1:
        exit_with_parent(int(argv[1]))
    channel = os.fdopen(int(argv[0]), "w", encoding="utf-8", buffering=1)

    def send(**message) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    job = json.loads(sys.stdin.read())
    logs.set_verbosity(quiet=job["quiet"], verbose=job["verbose"])
    logs.set_terminal(job["terminal"])
    try:
        send(result=_lower(job, lambda line: send(say=line)))
    except UserError as error:
        send(error=str(error))
        return 2
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        from mtp_edge.memory import disk_full

        send(error=disk_full(error.filename or job["directory"]))
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
