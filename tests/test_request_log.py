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


def test_a_torn_record_spoils_only_itself_and_readers_count_what_they_skip(tmp_path, capsys):
    """A writer killed mid-append leaves a record without its newline: the next append starts a
    line of its own, and readers skip a line that is not JSON wherever it is, and say so."""
    log = RequestLog(tmp_path)
    log.append(CHAT, [5], 1.0)
    path = tmp_path / "requests.jsonl"
    with open(path, "a") as f:
        f.write('{"messages": [{"role": "us')  # a writer killed mid-append
    assert len(list(read_log(tmp_path))) == 1  # torn last line
    log.append([{"role": "user", "content": "after"}], [6], 1.0)
    assert path.read_text().split("\n")[1] == '{"messages": [{"role": "us'
    skipped: list[str] = []
    records = list(read_log(tmp_path, skipped))
    assert [r.messages[-1]["content"] for r in records] == ["Hi!", "after"]
    assert skipped == [f"{path}:2"]
    capsys.readouterr()
    # and one more first, cut in the middle of a character
    path.write_bytes('{"messages": [{"content": "é'.encode()[:-1] + b"\n" + path.read_bytes())
    assert [r.answer_ids for r in read_log(tmp_path)] == [[5], [6]]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "skipped 2 lines that are not JSON" in err[0]
    assert f"first at {path}:1" in err[0]


def test_a_short_write_is_finished_and_a_failed_one_taken_back(tmp_path, monkeypatch):
    """os.write may write part of a record: the rest follows. A write that fails (a full disk)
    leaves the log as it was, and is a one-line error."""
    import errno
    import os

    log = RequestLog(tmp_path)
    log.append(CHAT, [1], 1.0)
    path = tmp_path / "requests.jsonl"
    real_write = os.write
    with monkeypatch.context() as m:
        m.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
        log.append([{"role": "user", "content": "in pieces"}], list(range(30)), 2.0)
    assert [r.answer_ids for r in read_log(tmp_path)] == [[1], list(range(30))]
    before = path.read_bytes()
    calls = []

    def full_disk(fd, data):
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, bytes(data[:10]))

    with monkeypatch.context() as m:
        m.setattr(os, "write", full_disk)
        with pytest.raises(UserError, match="No space left on device") as e:
            log.append([{"role": "user", "content": "lost"}], [2], 1.0)
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    assert path.read_bytes() == before


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
        [{"role": "user", "content": "hello there"}],
        CHAT,
        CHAT,
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
        ("Hi!", 40, True),
        ("why?", 128, True),
        ("the the the", 16, False),
    ]
    assert prompts[1].messages == turn
    gen = assemble(LoadOptions(model=str(chat_tiny_dir), drafter="ngram", max_seq_len=256))
    body = run_suite(gen.session, gen.encode, gen.drafter, prompts, gen.config, max_new_tokens=12)
    assert len(body["prompts"]) == 3 and all(row["identical"] for row in body["prompts"])
    # a conversation is encoded whole, not as its last message alone
    assert len(gen.encode(prompts[1].request)) > len(gen.encode("why?"))


def test_a_prompt_of_token_ids_is_logged_to_encode_back_to_its_ids(chat_tiny_dir, tmp_path):
    """Logged token-id prompts keep their special tokens in the text, and read back (by the
    adapting model's store and by mtp-train) as the very ids that were generated from."""
    import mtp_edge
    from mtp_edge.request_log import raw_prompt_ids
    from mtp_edge.train.prompts import encode_request, read_prompts

    llm = mtp_edge.load(chat_tiny_dir, drafter="ngram", max_seq_len=256, log=tmp_path)
    tok = llm.tokenizer
    im_end = tok.backend.token_to_id("<|im_end|>")
    plain = tok.encode_prompt("hello there", chat=False)
    prompts = [
        plain,  # text the server encoded: logged as that text alone
        tok.encode_prompt("hi <|im_end|> there", chat=False, parse_special=True),
        [tok.bos_id, im_end, 0],  # all special
        plain[1:],  # no bos, where the tokenizer adds one
    ]
    for ids in prompts:
        llm.generate(ids, max_new_tokens=2)
    messages = [r.messages for r in read_log(tmp_path)]
    assert messages[0] == [{"role": "user", "content": "hello there", "raw": True}]
    assert "<|im_end|>" in messages[1][0]["content"]
    assert messages[2][0]["content"] == "<|im_end|><|endoftext|>"
    assert [raw_prompt_ids(tok, m[0]) for m in messages] == prompts
    assert [llm._logged_prompt_ids(m) for m in messages] == prompts
    assert [encode_request(tok, r) for r in read_prompts(str(tmp_path))] == prompts
