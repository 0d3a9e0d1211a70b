"""`mtp-bench --compare`: each setup (bundle, k, drafter) measured in a process of its own.

Runtimes keep state between calls that a neighbour in the same process pays for: onnxruntime's
shared thread pool keeps its workers spinning after a call, ExecuTorch's threadpool and torch's
OpenMP threads have their own habits, and all of them were sized for the whole machine. Measured
side by side in one process, the ONNX bundle's speculative decoding fell to 0.82x of its own
plain decoding (1.29x alone). So every setup gets a worker process; the parent hands the same
prompt to each in turn (machine drift still affects all alike) and only one works at a time.

Parent and workers talk JSON over a pipe: prompts out, result rows and the final report back.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import signal
import traceback

from mtp_edge.devices.harness import Prompt
from mtp_edge.errors import UserError
from mtp_edge.runtime.assemble import LoadOptions


def compare_spec(spec: str) -> dict:
    """`DIR[,k=N][,drafter=NAME][,draft_confidence=P][,fallback=on|off]` -> the LoadOptions
    fields it overrides (confidence=P: an older name of draft_confidence=P)."""
    path, *settings = spec.split(",")
    out: dict = {"bundle": path}
    for setting in settings:
        key, _, value = setting.partition("=")
        if key == "k" and value.isdigit():
            out["k"] = int(value)
        elif key == "drafter" and value:
            out["drafter"] = value
        elif key in ("draft_confidence", "confidence") and _is_probability(value):
            out["draft_confidence"] = float(value)
        elif key == "fallback" and value in ("on", "off"):
            out["fallback"] = value == "on"
        else:
            raise UserError(
                f"--compare {spec}: expected DIR[,k=N][,drafter=NAME][,draft_confidence=P]"
                "[,fallback=on|off], "
                f"not {setting!r}"
            )
    return out


def _is_probability(text: str) -> bool:
    try:
        return 0.0 <= float(text) <= 1.0
    except ValueError:
        return False


class IsolatedSetup:
    """A worker process that loads one setup and measures prompts on request."""

    def __init__(self, options: LoadOptions, repeat: int, max_new_tokens: int | None):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        opts = json.dumps(dataclasses.asdict(options))
        self.process = context.Process(
            target=_serve, args=(child, opts, repeat, max_new_tokens), daemon=True
        )
        self.process.start()
        child.close()
        self.done = 0  # rows received
        self.label = self._receive()["label"]

    def run_prompt(self, prompt: Prompt) -> dict:
        self.conn.send_bytes(json.dumps({"prompt": dataclasses.asdict(prompt)}).encode())
        row = self._receive()
        self.done += 1
        return row

    def report(self, command: str, peer: bool = True) -> dict | None:
        """The report over the prompts the worker measured (None if none). After a stop the
        worker may still be measuring a prompt whose row was never read (the stop came between
        sending it and reading its row, or the worker finishes it: it ignores Ctrl-C): that row
        comes first and is counted; the report is the message tagged as one."""
        self.conn.send_bytes(json.dumps({"report": command, "peer": peer}).encode())
        while True:
            message = self._receive()
            if set(message) == {"report"}:
                break
            self.done += 1  # the row of a prompt sent before the stop
        self.close()
        return message["report"]

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()

    def _receive(self) -> dict:
        try:
            message = json.loads(self.conn.recv_bytes())
        except EOFError:
            self.process.join()
            raise RuntimeError(
                f"a benchmark worker died (exit code {self.process.exitcode})"
            ) from None
        if "user_error" in message:
            self.close()
            raise UserError(message["user_error"])
        if "crash" in message:
            self.close()
            raise RuntimeError(f"a benchmark worker failed:\n{message['crash']}")
        return message


def _serve(conn, opts_json: str, repeat: int, max_new_tokens: int | None) -> None:
    """The worker: load the setup, then answer prompt and report requests until told to stop."""
    from mtp_edge.devices.harness import Suite, bench_report
    from mtp_edge.logs import quiet_library_noise
    from mtp_edge.runtime.assemble import assemble

    quiet_library_noise()
    # Ctrl-C reaches the whole process group: the parent decides (it asks for the report of
    # the prompts done, or kills the worker).
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def send(message: dict) -> None:
        conn.send_bytes(json.dumps(message).encode())

    try:
        gen = assemble(LoadOptions(**json.loads(opts_json)))
        suite = Suite(gen.config.k, repeat)
        send({"label": gen.label})
        ran: list[Prompt] = []  # the prompts measured, in order: what a report covers
        while True:
            message = json.loads(conn.recv_bytes())
            if "prompt" in message:
                p = Prompt(**message["prompt"])
                row = suite.run_prompt(
                    gen.session, gen.encode, gen.drafter, p, gen.config, max_new_tokens
                )
                ran.append(p)
                send(row)
            else:
                report = None
                if ran:
                    report = bench_report(
                        gen,
                        suite,
                        message["report"],
                        ran,
                        max_new_tokens,
                        _to_stderr,
                        peer=message.get("peer", True),
                    )
                send({"report": report})
                return
    except KeyboardInterrupt:  # only if raised before SIGINT was ignored
        return
    except UserError as e:
        send({"user_error": str(e)})
    except Exception:
        send({"crash": traceback.format_exc()})


def _to_stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)
