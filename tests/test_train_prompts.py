"""mtp-train --prompts: the user's requests as .txt, .jsonl ("prompt" or "messages") or a folder
of them and of request logs; repeats dropped; bad lines refused with file and line before any
long work; a run answers them, holds some out and reports "tau on your requests"."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner
from tiny import save_chat_dir

from mtp_edge.cli.train import train as train_cli
from mtp_edge.errors import UserError
from mtp_edge.request_log import RequestLog
from mtp_edge.train import Sequence, TrainOptions, train_heads
from mtp_edge.train.options import artifact_paths
from mtp_edge.train.prompts import YOURS, read_prompts
from mtp_edge.train.stages import _split_text

WORDS = "the cat sat on a mat and then the dog ran to the park while birds sang in trees".split()


def test_text_and_jsonl_files(tmp_path):
    txt = tmp_path / "asks.txt"
    txt.write_text("How do I sort a list?\n\n  Write a haiku about rain  \nHow do I sort a list?\n")
    assert read_prompts(str(txt)) == ["How do I sort a list?", "Write a haiku about rain"]
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},  # the answer it got: not part of the request
    ]
    rows = [
        {"prompt": "Explain recursion"},
        {"messages": conversation},
        {"messages": conversation[:2]},  # the same request: dropped
        {"prompt": "Explain recursion"},
    ]
    jsonl = tmp_path / "asks.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert read_prompts(str(jsonl)) == [
        "Explain recursion",
        ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}),
    ]


def test_a_folder_with_request_logs(tmp_path):
    folder = tmp_path / "logs"
    log = RequestLog(folder, file_bytes=1024, keep=3)
    for i in range(12):  # enough to rotate: requests.1.jsonl ... hold the older ones
        log.append([{"role": "user", "content": f"question number {i} " + "x" * 60}], [5, 6], 1.5)
    (folder / "more.txt").write_text("one more question\n")
    requests = read_prompts(str(folder))
    assert len(list(folder.glob("requests*.jsonl"))) > 1
    asked = [r[0]["content"].split(" x")[0] for r in requests if not isinstance(r, str)]
    numbers = [int(a.split()[2]) for a in asked]
    assert numbers == sorted(numbers) and numbers[-1] == 11  # oldest first, the newest kept
    assert requests[-1] == "one more question"


@pytest.mark.parametrize(
    "name, text, fragment",
    [
        ("a.jsonl", '{"prompt": "fine"}\n{"prompt": \n', "a.jsonl:2: not a JSON line"),
        (
            "a.jsonl",
            '{"prompt": "fine"}\n{"text": "x"}\n',
            'a.jsonl:2: expected a non-empty "prompt"',
        ),
        ("a.jsonl", '["x"]\n', "a.jsonl:1: expected a JSON object"),
        (
            "a.jsonl",
            '{"prompt": "ok"}\n\n{"messages": [{"role": "robot", "content": "x"}]}\n',
            "a.jsonl:3: unknown role",
        ),
        (
            "a.jsonl",
            '{"messages": [{"role": "assistant", "content": "x"}]}\n',
            "a.jsonl:1: the messages hold no user message",
        ),
        (
            "a.jsonl",
            '{"prompt": "ok"}\n{"messages": [{"role": "user", "content": "", "raw": true}]}\n',
            "a.jsonl:2: the request is empty",
        ),
        (
            "a.jsonl",
            '{"messages": [{"role": "user", "content": "  "}]}\n',
            "a.jsonl:1: the request is empty",
        ),
        ("a.txt", "fine\n\\n\n", "a.txt:2: the request is empty"),
        ("a.txt", "\n\n", "no requests in it"),
        ("a.csv", "x,y\n", "give a .txt file"),
    ],
)
def test_bad_lines_are_one_line_errors(tmp_path, name, text, fragment):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(UserError, match=None) as caught:
        read_prompts(str(path))
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_a_logs_torn_and_empty_records_are_skipped_and_counted(tmp_path, capsys):
    """The server answers an empty completion prompt, and a killed writer leaves a torn record:
    mtp-train --prompts LOGDIR skips both (they hold nothing to learn), in one warning line."""
    log = RequestLog(tmp_path)
    log.append([{"role": "user", "content": "first question"}], [5], 1.0)
    with open(tmp_path / "requests.jsonl", "a") as f:
        f.write('{"messages": [{"role": "us')  # a writer killed mid-append
    log.append([{"role": "user", "content": "", "raw": True}], [6], 1.0)
    log.append([{"role": "user", "content": "", "raw": True, "token_ids": []}], [6], 1.0)
    log.append([{"role": "user", "content": "second question", "raw": True}], [7], 1.0)
    capsys.readouterr()
    requests = read_prompts(str(tmp_path))
    assert [r[0]["content"] for r in requests] == ["first question", "second question"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "skipped 1 line that is not JSON" in err[0], err
    assert f"2 empty requests (first at {tmp_path / 'requests.jsonl'}:3)" in err[0]
    only_empty = tmp_path / "empty"
    RequestLog(only_empty).append([{"role": "user", "content": "", "raw": True}], [6], 1.0)
    with pytest.raises(UserError, match="no requests in it"):
        read_prompts(str(only_empty))


def test_logged_token_ids_are_the_requests_ids(chat_tiny_dir, tmp_path):
    """A raw request with "token_ids" (a prompt of ids whose text does not encode back to them)
    is trained on those ids; ids outside the target's vocabulary are refused."""
    from mtp_edge.tokenizer import Tokenizer
    from mtp_edge.train.prompts import encode_request

    tok = Tokenizer.from_hf_dir(chat_tiny_dir)
    ids = [tok.bos_id, 2, 0, 17]
    RequestLog(tmp_path).append(
        [{"role": "user", "content": "x", "raw": True, "token_ids": ids}], [5], 1.0
    )
    (request,) = read_prompts(str(tmp_path))
    assert encode_request(tok, request) == ids
    alien = ({"role": "user", "content": "x", "raw": True, "token_ids": [tok.vocab_size]},)
    with pytest.raises(UserError, match="not the target's"):
        encode_request(tok, alien)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{**request[0], "token_ids": ["a"]}]}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl:1: \"token_ids\" must be a list"):
        read_prompts(str(bad))


def test_requests_too_long_to_train_on_are_said_or_refused(tmp_path):
    """Requests longer than the training sequences are left out, and the run says how many; with
    none left it stops before writing anything (it would train on the default text alone)."""
    save_chat_dir(tmp_path / "model", hidden_size=32, intermediate_size=64)
    long_asks = [" ".join(WORDS * 2) for _ in range(2)]
    asks = tmp_path / "asks.txt"
    asks.write_text("\n".join(f"{i} {text}" for i, text in enumerate(long_asks)) + "\n")
    out = tmp_path / "run" / "heads.safetensors"
    options = TrainOptions(
        out=str(out), model=str(tmp_path / "model"), prompts=str(asks), steps=2,
        gen_tokens=100, gen_max_new=4, gen_batch=8, raw_tokens=200, batch_size=32, seq_len=64,
        draft_vocab=48, warmup=1, eval_every=10, writer="fp32", labeller="fp32", heldout=0.2,
    )  # fmt: skip
    with pytest.raises(UserError, match=r"all 2 requests are longer than the training sequences "
                       r"\(64 tokens; the shortest has \d+\)"):  # fmt: skip
        train_heads(options, lambda line: None)
    assert not artifact_paths(out)["generated"].exists()

    asks.write_text(asks.read_text() + "the cat sat\nthe dog ran\n")
    lines: list[str] = []
    train_heads(options, lines.append)
    assert "skipped 2 of 4 of your requests, longer than the training sequences (64 tokens)" in (
        lines
    )
    assert any(line.startswith("answers to your requests: 2 of 4") for line in lines), lines


def test_the_cli_refuses_bad_prompts_before_loading(tmp_path):
    """Exit 2 with one line naming the file and line, before the model loads (there is none
    at the path given: loading would fail with another message) and before writing anything."""
    bad = tmp_path / "asks.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    out = tmp_path / "out" / "heads.safetensors"
    args = ["--model", str(tmp_path / "no-model"), "--prompts", str(bad), "--out", str(out)]
    result = CliRunner().invoke(train_cli, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"{bad}:2" in lines[0] and lines[0].startswith("error:")
    assert not out.exists() and not artifact_paths(out)["generated"].exists()
    missing = CliRunner().invoke(
        train_cli, [*args[:2], "--prompts", str(tmp_path / "x.txt"), "--out", str(out)]
    )
    assert missing.exit_code == 2 and "no such file" in missing.output
    both = CliRunner().invoke(train_cli, [*args, "--data", str(bad)])
    assert both.exit_code == 2 and "give one" in both.output


def test_the_users_requests_are_split_on_their_own():
    """Each held-out part gets its share of the user's requests; without them the split is the
    plain one (the same text, the same heads as before --prompts existed)."""
    plain = [Sequence([1, 2, 3], 0, "code") for _ in range(40)]
    yours = [Sequence([4, 5, 6, i], 2, YOURS) for i in range(20)]
    train, heldout = _split_text(plain + yours, 0.1, 0, 1)
    assert not set(train) & set(heldout) and len(train) + len(heldout) == 60
    assert sum(i >= 40 for i in heldout) == 2 and sum(i < 40 for i in heldout) == 4
    from mtp_edge.train.stages import _split

    assert _split_text(plain, 0.1, 0, 1) == _split(40, 0.1, 0, 1)


def test_a_requests_answers_stay_on_one_side_of_the_split():
    """With several answers per request: a held-out request keeps only its first (greedy)
    answer, none of a held-out request's answers is trained on, every other answer is."""
    plain = [Sequence([1, 2, 3], 0, "code") for _ in range(40)]
    yours = [Sequence([4, 5, r, a], 2, YOURS, f"request {r}") for r in range(20) for a in range(3)]
    train, heldout = _split_text(plain + yours, 0.1, 0, 1)
    held = [(plain + yours)[i] for i in heldout if i >= 40]
    assert len(held) == 2 and all(s.tokens[3] == 0 for s in held)  # the first answers
    held_groups = {s.group for s in held}
    trained = [(plain + yours)[i] for i in train if i >= 40]
    assert not {s.group for s in trained} & held_groups
    assert len(trained) == 3 * (20 - len(held_groups))
    # One answer each: the split of the requests is the one before answers were grouped.
    single = [Sequence([4, 5, 6, i], 2, YOURS, f"request {i}") for i in range(20)]
    ungrouped = [Sequence([4, 5, 6, i], 2, YOURS) for i in range(20)]
    assert _split_text(plain + single, 0.1, 0, 1) == _split_text(plain + ungrouped, 0.1, 0, 1)


def test_several_answers_per_request(tmp_path):
    """--answers-per-request 3: after each request's greedy answer, sampled ones (cached under
    their own keys, recorded in the recipe), while the share has room; refused where it
    cannot sample or is below 1."""
    save_chat_dir(tmp_path / "model", hidden_size=32, intermediate_size=64)
    rng = random.Random(1)
    asks = tmp_path / "asks.txt"
    asks.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(6)) for _ in range(12)))
    out = tmp_path / "run" / "heads.safetensors"
    options = TrainOptions(
        out=str(out), model=str(tmp_path / "model"), prompts=str(asks), steps=4,
        gen_tokens=400, gen_max_new=8, gen_batch=8, raw_tokens=200, batch_size=32, seq_len=64,
        draft_vocab=48, warmup=2, eval_every=10, writer="fp32", labeller="fp32", heldout=0.2,
        answers_per_request=3, prompts_share=0.9,
    )  # fmt: skip
    lines: list[str] = []
    train_heads(options, lines.append)
    written = [
        json.loads(line) for line in artifact_paths(out)["generated"].read_text().splitlines()
    ]
    asked = set(read_prompts(str(asks)))
    greedy = {e["prompt"]: e["response_ids"] for e in written if e["prompt"] in asked}
    sampled = [e for e in written if "\x00sample " in e["prompt"]]
    assert len(greedy) == len(asked) and sampled
    assert {e["prompt"].split("\x00")[0] for e in sampled} <= asked
    assert any(e["response_ids"] != greedy[e["prompt"].split("\x00")[0]] for e in sampled)
    line = next(x for x in lines if x.startswith("answers to your requests:"))
    assert f"{len(asked)} of {len(asked)} (+" in line and "sampled answers)" in line
    recipe = json.loads(out.with_suffix(".json").read_text())["recipe"]
    assert recipe["answers_per_request"] == 3
    for bad, message in (
        ({"answers_per_request": 0}, "--answers-per-request must be >= 1"),
        ({"answers_per_request": 2, "writer": "bundle", "bundle": "b"}, "--writer fp32 or int8"),
    ):
        with pytest.raises(UserError, match=message):
            TrainOptions(out=str(out), **bad)


def test_a_run_answers_your_requests_and_reports_them(tmp_path):
    save_chat_dir(tmp_path / "model", hidden_size=32, intermediate_size=64)
    rng = random.Random(0)
    asks = tmp_path / "asks.jsonl"
    rows = [{"prompt": " ".join(rng.choice(WORDS) for _ in range(6))} for _ in range(24)]
    rows += [{"messages": [{"role": "user", "content": "the cat and the dog"}]}]
    asks.write_text("\n".join(json.dumps(r) for r in rows + rows[:3]) + "\n")
    out = tmp_path / "run" / "heads.safetensors"
    options = TrainOptions(
        out=str(out), model=str(tmp_path / "model"), prompts=str(asks), steps=20,
        gen_tokens=200, gen_max_new=8, gen_batch=8, raw_tokens=200, batch_size=32, seq_len=64,
        draft_vocab=48, warmup=5, eval_every=10, writer="fp32", labeller="fp32", heldout=0.2,
    )  # fmt: skip
    lines: list[str] = []
    summary = train_heads(options, lines.append)
    written = [
        json.loads(line) for line in artifact_paths(out)["generated"].read_text().splitlines()
    ]
    asked = {r["prompt"] for r in rows if "prompt" in r}
    answered = [e for e in written if e["prompt"] in asked]
    assert answered and len(answered) <= len(asked)  # each at most once (repeats dropped)
    assert any(e["prompt"] not in asked for e in written)  # mixed with the default text
    assert any(line.startswith("answers to your requests:") for line in lines)
    assert summary["your_requests_tau"] >= 1
    assert "tau on your requests" in summary["report"]
    recipe = json.loads(out.with_suffix(".json").read_text())
    assert recipe["recipe"]["prompts"] == "asks.jsonl" and recipe["recipe"]["prompts_share"] == 0.75
    # every evaluation measured the held-out requests too, and the heads kept are the best there
    history = summary["history"]
    assert [h["step"] for h in history] == [0, 10, 20]
    assert all(h["yours_tau"] >= 1 for h in history)
    best = next(h for h in history if h["step"] == summary["best_step"])
    assert best["yours_tau"] == max(h["yours_tau"] for h in history)
    assert any("your requests tau~" in line for line in lines if line.startswith("step "))

    # Refined from those heads with a learning rate too small to change a weight: no step beats the
    # start, which is written as it was, and the run says so.
    again = tmp_path / "again" / "heads.safetensors"
    lines.clear()
    options = replace(options, out=str(again), init=str(out), lr=1e-30)
    summary = train_heads(options, lines.append)
    assert summary["best_step"] == 0
    assert any(line.startswith("note: no step beat the heads of --init") for line in lines)


def test_the_users_held_out_requests_choose_the_best_heads():
    """With --prompts the held-out answers to the user's requests decide which heads a run
    keeps: the rest of the held-out text may be text the --init heads trained on."""
    from mtp_edge.train.state import Scores

    head = torch.nn.Linear(2, 2)
    scores = Scores(recipe={})
    scores.remember({"step": 0, "tau": 3.0, "loss": 1.0, "yours_tau": 1.5}, head)
    scores.remember({"step": 100, "tau": 2.2, "loss": 2.0, "yours_tau": 1.9}, head)
    scores.remember({"step": 200, "tau": 2.5, "loss": 1.5, "yours_tau": 1.8}, head)
    assert scores.best_entry["step"] == 100
    plain = Scores(recipe={})  # no requests of the user's: the whole held-out tau
    for entry in ({"step": 0, "tau": 3.0, "loss": 1.0}, {"step": 100, "tau": 2.2, "loss": 2.0}):
        plain.remember(entry, head)
    assert plain.best_entry["step"] == 0


def test_gen_max_new_reaches_the_writer(tmp_path, monkeypatch):
    """--gen-max-new caps every response the target writes (shorter answers to --prompts cost
    less to write); 0 is refused before any work."""
    import mtp_edge.train

    seen = {}

    def fake_train_heads(options, progress):
        seen["gen_max_new"] = options.gen_max_new
        return {}

    monkeypatch.setattr(mtp_edge.train, "train_heads", fake_train_heads)
    out = str(tmp_path / "heads.safetensors")
    result = CliRunner().invoke(train_cli, ["--gen-max-new", "96", "--out", out])
    assert result.exit_code == 0, result.output
    assert seen == {"gen_max_new": 96}
    result = CliRunner().invoke(train_cli, ["--out", out])
    assert seen == {"gen_max_new": 256}
    refused = CliRunner().invoke(train_cli, ["--gen-max-new", "0", "--out", out])
    assert refused.exit_code == 2 and "--gen-max-new" in refused.output
