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


def test_the_api_logs_each_request_only_when_asked(chat_tiny_dir, tmp_path, monkeypatch):
    import mtp_edge

    monkeypatch.chdir(tmp_path)  # a log written anywhere by default would land here
    plain = mtp_edge.load(chat_tiny_dir, drafter="ngram", max_seq_len=256)
    first = plain.generate("hello there", max_new_tokens=8)
    plain.chat(CHAT, max_new_tokens=4)
    assert list(tmp_path.iterdir()) == []  # nothing written without log=

    logged = mtp_edge.load(chat_tiny_dir, drafter="ngram", max_seq_len=256, log=tmp_path / "log")

    again = logged.generate("hello there", max_new_tokens=8)
    answer = logged.chat(CHAT, max_new_tokens=6)
    streamed = [c.token_ids for c in logged.stream_chat(CHAT, max_new_tokens=5)]
    records = list(read_log(tmp_path / "log"))
    assert [r.messages for r in records] == [
        [{"role": "user", "content": "hello there"}], CHAT, CHAT
    ]
    assert records[0].answer_ids == again.token_ids == first.token_ids  # logging changes nothing
    assert records[1].answer_ids == answer.token_ids
    assert records[1].tau == round(answer.stats.tau, 4)
    assert records[2].answer_ids == sum(streamed, [])
    assert all(r.tau >= 1 for r in records)


def test_an_unwritable_log_is_refused_before_the_load(tmp_path):
    import mtp_edge

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match="cannot write the request log"):
        mtp_edge.load("does-not-exist", log=blocker / "log")
    with pytest.raises(UserError, match="log takes a folder path"):
        mtp_edge.load("does-not-exist", log=5)


def test_bench_reads_a_request_log_as_its_suite(chat_tiny_dir, tmp_path):
    """mtp-bench --prompts LOG_DIR: each distinct conversation once, multi-turn ones whole,
    decoded plain and speculative with identical output."""
    from mtp_edge.devices.harness import load_prompts, run_suite
    from mtp_edge.runtime.assemble import LoadOptions, assemble

    log = RequestLog(tmp_path)
    turn = [*CHAT, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "why?"}]
    log.append(CHAT, list(range(40)), 1.2)
    log.append(CHAT, [3], 1.0)  # the same request again: benched once
    log.append(turn, [], 1.0)
    log.append([{"role": "user", "content": "the the the"}], [5] * 3, 2.0)
    prompts = load_prompts(tmp_path)
    assert [(p.prompt, p.max_new_tokens, p.messages is not None) for p in prompts] == [
        ("Hi!", 40, True), ("why?", 128, True), ("the the the", 16, False)
    ]
    assert prompts[1].messages == turn
    gen = assemble(LoadOptions(model=str(chat_tiny_dir), drafter="ngram", max_seq_len=256))
    body = run_suite(gen.session, gen.encode, gen.drafter, prompts, gen.config, max_new_tokens=12)
    assert len(body["prompts"]) == 3 and all(row["identical"] for row in body["prompts"])
    # a conversation is encoded whole, not as its last message alone
    assert len(gen.encode(prompts[1].request)) > len(gen.encode("why?"))
