"""Request logs: bounded, rotated, readable back, and broken lines named by file and line."""

from __future__ import annotations

import json
import threading

import pytest

from mtp_edge.errors import UserError
from mtp_edge.request_log import RequestLog, log_files, read_log

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def test_records_read_back_in_order(tmp_path):
    log = RequestLog(tmp_path)
    for i in range(3):
        log.append(CHAT + [{"role": "user", "content": f"n{i}"}], [i, i + 1], 1.5 + i, "eos", "m")
    records = list(read_log(tmp_path))
    assert [r.messages[-1]["content"] for r in records] == ["n0", "n1", "n2"]
    assert records[2].answer_ids == [2, 3] and records[2].tau == 3.5
    row = json.loads((tmp_path / "requests.jsonl").read_text().splitlines()[0])
    assert set(row) == {"time", "model", "messages", "answer_ids", "finish_reason", "tau"}


def test_the_log_is_bounded_and_rotated(tmp_path):
    log = RequestLog(tmp_path, file_bytes=2048, keep=2)
    for i in range(200):
        log.append([{"role": "user", "content": f"request {i} " + "x" * 40}], [1, 2, 3], 1.0)
    files = log_files(tmp_path)
    assert [f.name for f in files] == ["requests.2.jsonl", "requests.1.jsonl", "requests.jsonl"]
    assert all(f.stat().st_size <= 2048 for f in files)
    contents = [int(r.messages[0]["content"].split()[1]) for r in read_log(tmp_path)]
    assert contents == sorted(contents) and contents[-1] == 199  # the newest kept, in order
    assert len(contents) < 200  # the oldest were dropped


def test_threads_append_whole_lines(tmp_path):
    log = RequestLog(tmp_path, file_bytes=4096, keep=50)

    def write(t):
        for i in range(40):
            log.append([{"role": "user", "content": f"{t}-{i}"}], list(range(20)), 2.0)

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(list(read_log(tmp_path))) == 160


def test_a_torn_last_line_is_skipped_but_a_broken_middle_line_is_named(tmp_path):
    RequestLog(tmp_path).append(CHAT, [5], 1.0)
    path = tmp_path / "requests.jsonl"
    with open(path, "a") as f:
        f.write('{"messages": [{"role": "us')  # a writer killed mid-append
    assert len(list(read_log(tmp_path))) == 1
    path.write_text('{"messages": [}\n' + path.read_text())
    with pytest.raises(UserError, match=r"requests.jsonl:1: not a JSON line"):
        list(read_log(tmp_path))


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "user"}]}, "content"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role"),
        ({"messages": CHAT, "answer_ids": ["a"]}, "answer_ids"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_records_are_one_line_with_file_and_line(tmp_path, row, message):
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(UserError, match=message) as e:
        list(read_log(path))
    assert f"{path}:2:" in str(e.value) and "\n" not in str(e.value)


def test_an_unwritable_folder_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match="cannot write the request log"):
        RequestLog(blocker / "logs")
