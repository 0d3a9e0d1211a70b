"""mtp-chat in a pseudo-terminal, as a person uses it: turns, /stats, /reset, Ctrl-C during an
answer (SIGINT to the process, as the terminal sends it), Ctrl-D to leave."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest
from tiny import hf_reference, save_hf_dir

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STATS = re.compile(r"prompt (\d+) tokens: (\d+) cached, (\d+) prefilled")


class Terminal:
    """mtp-chat on the slave side of a pseudo-terminal; we read and type on the master side."""

    def __init__(self, *args: str):
        self.master, slave = os.openpty()
        code = "from mtp_edge.cli.chat import chat; chat()"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,  # its own terminal session, as in a real terminal
            env={**os.environ, "TERM": "dumb"},
        )
        os.close(slave)
        self.seen = ""

    def expect(self, pattern: str, timeout: float = 120) -> re.Match:
        """Wait for `pattern` in what arrived since the last match; consume up to its end."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.seen)
            if found:
                self.seen = self.seen[found.end() :]
                return found
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.seen[-2000:]!r}"
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    data = os.read(self.master, 4096)
                except OSError:  # the child closed the terminal
                    data = b""
                assert data, f"mtp-chat ended before {pattern!r}: {self.seen[-2000:]!r}"
                self.seen += data.decode(errors="replace").replace("\r\n", "\n")

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def leave_with_ctrl_d(self, presses: int = 3) -> None:
        """Ctrl-D at an empty prompt. A press that lands while the line editor is switching the
        terminal's mode may be taken as an empty edit rather than an end of input, so, as a
        person would, press again if the program is still there after a few seconds."""
        for _ in range(presses):
            self.type("\x04")
            try:
                self.process.wait(timeout=10)
                return
            except subprocess.TimeoutExpired:
                continue

    def close(self) -> int:
        try:
            return self.process.wait(timeout=60)
        finally:
            os.close(self.master)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    model = save_hf_dir(hf_reference("llama", seed=3, max_position_embeddings=8192), root / "m")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return model


def test_two_turns_stats_reset_and_ctrl_d(model_dir):
    """Lines typed ahead wait in the terminal, as when a person types during an answer. Every
    reply is on the screen before the next prompt ("> ") is drawn, never after it."""
    terminal = Terminal("--model", str(model_dir), "-n", "6", "--system", "be brief")
    try:
        terminal.expect(r"mtp-chat: .*drafter ngram.*/help for commands\n> ")
        terminal.type("/stats\n")
        terminal.expect(r"no answer yet\n> ")
        terminal.type("the cat sat\n/stats\n")
        first = terminal.expect(STATS.pattern + r"\n> ")
        assert int(first[2]) == 0 and int(first[3]) == int(first[1])
        terminal.type("and then\n/stats\n")
        second = terminal.expect(STATS)
        # The second turn reused at least the whole first prompt: it prefilled only the rest.
        assert int(second[2]) >= int(first[1])
        assert int(second[3]) == int(second[1]) - int(second[2])
        for _ in range(3):  # the order never depends on timing
            terminal.type("/reset\n")
            terminal.expect(r"new conversation\n> ")
        terminal.type("and then\n/stats\n")
        assert int(terminal.expect(STATS.pattern + r"\n> ")[2]) == 0
        terminal.type("/nonsense\n")
        terminal.expect(r"unknown command /nonsense; /help lists them\n> ")
        terminal.type("/help\n")
        terminal.expect(r"/reset.*\n.*/stats.*\n.*/save.*\n.*/help.*\n.*Ctrl-C stops an answer\n> ")
        terminal.leave_with_ctrl_d()
    finally:
        code = terminal.close()
    assert code == 0
    assert "Traceback" not in terminal.seen


def test_ctrl_c_stops_the_answer_not_the_program(model_dir):
    args = ("--model", str(model_dir), "--max-seq-len", "8192", "-n", "8000")
    terminal = Terminal(*args)
    try:
        terminal.expect(r"mtp-chat: ")
        terminal.type("the cat sat\n")
        terminal.expect(r"the cat sat\n")  # the echo of the line typed
        terminal.expect(r"\S{20}")  # the answer is streaming (it would run for 8000 tokens)
        terminal.process.send_signal(signal.SIGINT)
        terminal.expect(r"\[stopped\]")
        terminal.type("/stats\n")
        stats = terminal.expect(r"\[interrupted\] " + STATS.pattern)
        assert int(stats[2]) == 0
        # At the prompt: a hint, not an exit. A Ctrl-C that lands after the stats line but
        # before input() waits for the line asks for nothing, so press again as a person would.
        for _ in range(20):
            terminal.process.send_signal(signal.SIGINT)
            try:
                terminal.expect(r"Ctrl-D or /exit quits", timeout=3)
                break
            except AssertionError:
                assert terminal.process.poll() is None, "Ctrl-C at the prompt ended mtp-chat"
        else:
            raise AssertionError(f"no hint after Ctrl-C at the prompt: {terminal.seen!r}")
        terminal.type("/exit\n")
    finally:
        code = terminal.close()
    assert code == 0
    assert "Traceback" not in terminal.seen


def test_a_model_without_a_chat_template_is_one_line(tmp_path):
    model = save_hf_dir(hf_reference("llama", seed=3), tmp_path / "plain")
    code = "from mtp_edge.cli.chat import chat; chat()"
    done = subprocess.run(
        [sys.executable, "-c", code, "--model", str(model)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "no chat template" in done.stderr and "Traceback" not in done.stderr
