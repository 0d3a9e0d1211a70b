"""mtp-train --minutes (stages on deadlines, resuming with the time spent), the draft vocabulary
sized by coverage, the best held-out heads kept, and the report. Time here is a clock the tests
drive: every reading advances it, so a run's deadlines fall on the same work on any machine."""

from __future__ import annotations

import json
import random

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from tiny import hf_reference, save_hf_dir, tiny_model

from mtp_edge.checkpoints import load_model
from mtp_edge.cli import train
from mtp_edge.errors import UserError
from mtp_edge.mtp import MTPConfig, MTPHead, load_heads, target_lm_head
from mtp_edge.train import TrainOptions, generate, generate_batch, train_heads
from mtp_edge.train.budget import (
    EVALUATION_SHARE,
    MAX_WRITING_SHARE,
    MIN_WRITING_SHARE,
    OFFLINE_SHARE,
    PASSES_PER_ORIGIN,
    SELF_WRITTEN_SHARE,
    Budget,
)
from mtp_edge.train.final_report import final_report
from mtp_edge.train.labels import (
    AUTO_VOCAB_RANGE,
    COVERAGE_GOAL,
    Labels,
    coverage_vocabulary_size,
)
from mtp_edge.train.losses import IGNORE, evaluate, rope_tables
from mtp_edge.train.options import artifact_paths

WORDS = "the cat sat on a mat and then the dog ran to the park while birds sang in trees".split()


class TickingClock:
    """A clock that advances `tick` seconds at every reading."""

    def __init__(self, tick: float):
        self.now, self.tick = 1000.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny HF model directory (a 2048-token vocabulary, so that the draft vocabulary is
    chosen) and a text file of words."""
    root = tmp_path_factory.mktemp("budget")
    reference = hf_reference(
        "llama",
        vocab=2048,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    save_hf_dir(reference, root / "model", vocab=2048)
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(20)) for _ in range(300))
    (root / "words.txt").write_text(text)
    return root


def options(root, name: str, **overrides) -> TrainOptions:
    values = dict(
        out=str(root / name / "heads.safetensors"),
        model=str(root / "model"),
        data=(str(root / "words.txt"),),
        batch_size=64,
        seq_len=64,
        lr=3e-3,
        warmup=10,
    )
    values.update(overrides)
    return TrainOptions(**values)


def spent(out) -> dict:
    return json.loads(artifact_paths(out)["checkpoint_json"].read_text())["budget"]["spent"]


def test_budget_writes_labels_trains_and_resumes(tiny_dir, monkeypatch):
    """--minutes on the default corpus: the target writes until its deadline, labelling and
    training stop on theirs, a checkpoint and valid heads are written, and the seconds spent
    per stage are recorded. --resume with more minutes reuses the text and labels, continues
    from the checkpoint and trains only for the minutes left; with none left it refuses."""
    settings = dict(data=(), raw_tokens=300, gen_max_new=12, gen_batch=3, minutes=1.0)
    first = options(tiny_dir, "budget", **settings)
    lines: list[str] = []
    summary = train_heads(first, lines.append, clock=TickingClock(0.05))
    paths = artifact_paths(first.out)
    assert paths["generated"].is_file() and paths["checkpoint"].is_file()
    stages = spent(first.out)
    assert {"writing", "labelling", "training", "evaluation"} <= set(stages)
    assert sum(stages.values()) <= 60 + 2  # evaluation may pass the budget by a few readings
    assert summary["steps"] >= 1 and summary["heldout_tau"] >= 1
    state = json.loads(paths["checkpoint_json"].read_text())
    assert state["step"] == summary["steps"] and state["budget"]["written_text"][0] > 0
    model = load_model(first.model)
    load_heads(first.out, model.model, model.name)
    assert "mtp-export --target android --model" in summary["report"]
    assert f"--heads {first.out}" in summary["report"]

    def no_writing(*args, **kwargs):
        raise AssertionError("a resumed run wrote text again")

    monkeypatch.setattr(generate, "generate_batch", no_writing)
    again = options(tiny_dir, "budget", **{**settings, "minutes": 1.5}, resume=True)
    lines = []
    resumed = train_heads(again, lines.append, clock=TickingClock(0.05))
    assert f"resumed at step {summary['steps']}" in lines
    assert sum("labels read from" in line for line in lines) == 2
    assert resumed["steps"] > summary["steps"]
    later = spent(again.out)
    assert later["training"] > stages["training"] and sum(later.values()) <= 90 + 2
    assert resumed["sequences"] == summary["sequences"]
    load_heads(again.out, model.model, model.name)

    with pytest.raises(UserError, match="already spent"):
        train_heads(options(tiny_dir, "budget", **settings, resume=True), print)


def test_an_interrupted_writing_counts_its_time(tiny_dir):
    """A run stopped while writing has recorded the seconds it wrote for; resumed, it counts
    them, reuses what was written and writes on until the writing deadline."""
    settings = dict(data=(), raw_tokens=300, gen_max_new=12, gen_batch=3, minutes=0.5)

    class Interrupted(Exception):
        pass

    def interrupt_after_writing(line: str) -> None:
        if line.startswith("the target's responses"):
            raise Interrupted

    with pytest.raises(Interrupted):
        train_heads(
            options(tiny_dir, "interrupted", **settings),
            interrupt_after_writing,
            clock=TickingClock(0.05),
        )
    out = tiny_dir / "interrupted" / "heads.safetensors"
    budget = json.loads(artifact_paths(out)["checkpoint_json"].read_text())["budget"]
    assert budget["spent"]["writing"] > 0 and "written_text" not in budget
    resumed = options(tiny_dir, "interrupted", **settings, resume=True)
    train_heads(resumed, print, clock=TickingClock(0.05))
    assert spent(out)["writing"] > budget["spent"]["writing"]
    assert sum(spent(out).values()) <= 30 + 2


def test_a_deadline_cuts_a_batch_to_prefixes():
    """The writer's deadline inside a batch: each row keeps a prefix of its greedy response;
    one during the prompts' prefill leaves every row empty."""
    model = tiny_model(seed=3, vocab=48)
    prompts = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7], [4, 4, 4, 4, 20]]
    full = generate_batch(model, prompts, 20, eos_ids=[3])
    heard = []  # tokens per call: 0 after each prompt's prefill, then per decoding step

    def deadline_after_five_steps(added: int) -> bool:
        heard.append(added)
        return len(heard) == len(prompts) + 5

    cut = generate_batch(model, prompts, 20, eos_ids=[3], on_step=deadline_after_five_steps)
    assert heard[: len(prompts)] == [0] * len(prompts) and sum(heard) == sum(map(len, cut))
    assert any(len(a) < len(b) for a, b in zip(cut, full, strict=True))
    for a, b in zip(cut, full, strict=True):
        assert a == b[: len(a)] and len(a) <= 5
    ended = []
    assert generate_batch(model, prompts, 20, [3], ended=ended, on_step=lambda _: True) == [
        [] for _ in prompts
    ]
    assert ended == [False] * len(prompts)


def test_training_stops_on_its_deadline_and_keeps_the_labels(tiny_dir):
    """--data (nothing to write): labelling and training stop on their deadlines, a run with
    too little time for all the text labels a prefix of it and says so."""
    clock = TickingClock(0.5)  # slow "machine": few sequences labelled, few steps
    lines: list[str] = []
    summary = train_heads(options(tiny_dir, "deadline", minutes=0.5), lines.append, clock=clock)
    assert any(line.startswith("labelled ") and "by the deadline" in line for line in lines)
    state = json.loads(
        artifact_paths(tiny_dir / "deadline" / "heads.safetensors")["checkpoint_json"].read_text()
    )
    assert state["step"] == summary["steps"]
    assert sum(state["budget"]["spent"].values()) <= 30 + 10 * 0.5


def test_the_split_rule():
    """Writing gets the seconds that buy the text training can read PASSES_PER_ORIGIN times in
    the time left (budget.py's formula), from the rates measured; labelling the same without
    writing; training what is left less the evaluation reserve."""
    now = [0.0]
    budget = Budget(2.0, clock=lambda: now[0])  # 120 s, of which 9.6 are kept for evaluation
    assert budget.room_s() == pytest.approx(120 * (1 - EVALUATION_SHARE))
    budget.label_tps, budget.step_s = 100.0, 1.0
    affordable = budget.room_s() / (1 / 100 + PASSES_PER_ORIGIN * 1.0 / 100)
    assert budget.offline_tokens(100, 50_000) == int(OFFLINE_SHARE * affordable)  # offline text
    budget.start_writing(batch_origins=100, text_tokens=0)
    room = budget.room_s()
    assert budget.writing_until == pytest.approx(MAX_WRITING_SHARE * room)  # no rate yet
    budget.writer_starts()
    now[0] = 1.0
    budget.wrote(20)  # 20 tokens/s
    per_token = 1 / 20 + 1.5 / 100 + PASSES_PER_ORIGIN * 1.0 / 100
    fixed = 20 * (1 / 100 + PASSES_PER_ORIGIN * 1.0 / 100)  # the 20 tokens already written
    more = (budget.room_s() - fixed) / per_token / 20
    assert MIN_WRITING_SHARE * room < 1.0 + more < MAX_WRITING_SHARE * room
    assert budget.writing_until == pytest.approx(1.0 + more)
    # The self-written requests' share of writing ends that share of the way to its deadline
    budget.writing_share = SELF_WRITTEN_SHARE
    assert budget.writing_deadline() == pytest.approx(SELF_WRITTEN_SHARE * (1.0 + more))
    now[0] = budget.writing_deadline()
    assert budget.writing_over()
    budget.writing_share = 1.0
    assert not budget.writing_over()
    now[0] = budget.writing_until
    assert budget.writing_over()
    label_share = (1 / 100) / (1 / 100 + PASSES_PER_ORIGIN * 1.0 / 100)
    assert budget.labelling_seconds(100) == pytest.approx(budget.room_s() * label_share)
    # 1.5 tokens labelled per draft origin (a prompt for every two response tokens): labelling
    # an origin costs 1.5 tokens' time, and gets that much more of the room
    label_share = (1.5 / 100) / (1.5 / 100 + PASSES_PER_ORIGIN * 1.0 / 100)
    assert budget.labelling_seconds(100, 1.5) == pytest.approx(budget.room_s() * label_share)
    assert budget.training_deadline() == pytest.approx(120 * (1 - EVALUATION_SHARE))


def test_draft_vocabulary_by_coverage():
    """The smallest multiple of 256 in [1024, 32768] whose most frequent tokens cover 99%."""
    counts = torch.zeros(50_000, dtype=torch.long)
    counts[:3000] = 33  # 99,000 of 100,000 predictions: 3000 tokens cover exactly 99%
    counts[3000:4000] = 1
    assert coverage_vocabulary_size(counts) == 3072  # 3000 rounded up to a multiple of 256
    counts[2999] = 32  # now 3000 tokens fall one short: the 3001st is needed
    assert coverage_vocabulary_size(counts) == 3072
    assert coverage_vocabulary_size(torch.ones(50_000)) == AUTO_VOCAB_RANGE[1]
    few = torch.zeros(50_000)
    few[:10] = 100
    assert coverage_vocabulary_size(few) == AUTO_VOCAB_RANGE[0]
    assert coverage_vocabulary_size(torch.ones(97)) == 97  # smaller than the range: all


def test_auto_vocabulary_on_a_tiny_model(tiny_dir):
    """--draft-vocab auto (the default) on a tiny model: the size covers COVERAGE_GOAL of the
    target's predictions in the training labels, and one multiple of 256 fewer would not."""
    opts = options(tiny_dir, "auto", steps=2)
    summary = train_heads(opts, print)
    path = artifact_paths(opts.out)["labels"]
    labels = load_file(str(path.with_name(path.name + ".train0.safetensors")))
    predictions = labels["argmax"][labels["starts"] + 1].tolist()
    frequencies = sorted(
        (predictions.count(t) for t in set(predictions)), reverse=True
    )  # independent of the code under test: plain counting
    size = summary["draft_vocab"]
    assert size % 256 == 0 and AUTO_VOCAB_RANGE[0] <= size <= 2048
    assert sum(frequencies[:size]) >= COVERAGE_GOAL * len(predictions)
    if size > AUTO_VOCAB_RANGE[0]:
        assert sum(frequencies[: size - 256]) < COVERAGE_GOAL * len(predictions)
    assert summary["coverage"] >= COVERAGE_GOAL and 0 < summary["heldout_coverage"] <= 1


def test_the_best_heldout_heads_are_kept(tiny_dir):
    """Heads trained further at a learning rate that ruins them: the file written is the best
    evaluated (here the start), and evaluating it again gives that evaluation's result."""
    good = options(tiny_dir, "good", steps=60, eval_every=30)
    train_heads(good, print)
    ruin = options(tiny_dir, "ruined", steps=20, eval_every=5, lr=3.0, warmup=1, init=good.out)
    summary = train_heads(ruin, print)
    history = summary["history"]
    best = max(history, key=lambda e: (e["tau"], -e["loss"]))
    assert summary["best_step"] == best["step"] != history[-1]["step"]
    assert summary["heldout_tau"] == best["tau"]

    target = load_model(ruin.model).model
    head = load_heads(ruin.out, target, "tiny").float()
    path = artifact_paths(ruin.out)["labels"]
    stored = load_file(str(path.with_name(path.name + ".heldout0.safetensors")))
    names = ("hidden", "tokens", "argmax", "remaining", "starts", "bounds", "keys", "values")
    heldout = Labels(*(stored.get(n) for n in names))
    to_draft = torch.full((target.config.vocab_size,), IGNORE, dtype=torch.long)
    to_draft[head.draft_ids] = torch.arange(len(head.draft_ids))
    weights = 0.8 ** torch.arange(4, dtype=torch.float32)
    again = evaluate(
        head, heldout, target.embed_tokens.weight, 4, to_draft, weights, 1,
        rope_tables(target.config, 80), target_lm_head(target)[head.draft_ids], False, 64,
    )  # fmt: skip
    assert again["tau"] == pytest.approx(best["tau"], abs=0.02)
    assert again["loss"] == pytest.approx(best["loss"], rel=0.02)


def test_the_report(tiny_dir):
    """One screen: held-out tau and acceptance per position, per kind of text when there are
    kinds (not otherwise), the draft step's measured cost, stage times, tokens, the export
    command."""
    loaded = load_model(str(tiny_dir / "model"))
    opts = options(tiny_dir, "report", steps=1, writer="int8", labeller="int8")
    head = MTPHead(MTPConfig(32, 64, 2048, 1024, k=4))
    summary = dict(
        heldout_acceptance=[0.5, 0.25, 0.125, 0.0625],
        heldout_tau=1.94,
        heldout_loss=3.0,
        history=[{}, {}],
        best_step=10,
        steps=20,
        draft_vocab=1024,
        coverage=0.991,
        heldout_coverage=0.95,
        train_tokens=5000,
    )
    now = [0.0]
    timer = Budget(1.0, clock=lambda: now[0])
    for stage, seconds in (("writing", 20), ("labelling", 5), ("training", 30)):
        timer.stage(stage)
        now[0] += seconds
    timer.write_tps, timer.label_tps = 100.0, 300.0
    kinds = {
        "code": {"tau": 2.1, "acceptance": [0.6, 0.3, 0.1, 0.1], "origins": 300},
        "math": {"tau": 1.5, "acceptance": [0.4, 0.1, 0.0, 0.0], "origins": 200},
    }
    text = {"sequences": 40, "written": 4000, "labelled": 6000}
    report = final_report(opts, "tiny", loaded.model, head, summary, kinds, timer, text)
    lines = report.splitlines()
    assert len(lines) <= 24
    assert "tau 1.94" in report and " 0.50  0.25  0.12  0.06" in report
    assert any(line.split()[:2] == ["code", "2.10"] for line in lines) and "(200)" in report
    assert "draft cost    a head step" in report and "of a target forward(1)" in report
    assert "writing 0:20, labelling 0:05, training 0:30 (total 0:55 of 1:00)" in report
    assert "4000 tokens written by the target, 6000 labelled" in report
    writer = next(line for line in lines if line.startswith("writer"))
    labeller = next(line for line in lines if line.startswith("labeller"))
    assert "100 tokens/s" in writer and "of this machine's int8 matmul peak" in writer
    assert "300 tokens/s" in labeller and labeller.endswith("measured; int8 target)")
    assert lines[-1].split() == [
        "export", "mtp-export", "--target", "android", "--model", opts.model, "--heads", opts.out
    ]  # fmt: skip
    without = final_report(opts, "tiny", loaded.model, head, summary, {}, timer, text)
    assert "by kind" not in without and "by kind" in report


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--minutes", "-1"], "--minutes must be > 0"),
        (["--minutes", "0"], "--minutes must be > 0"),
        (["--minutes", "5", "--steps", "100"], "give one"),
        (["--draft-vocab", "many"], "--draft-vocab must be a number of tokens or auto"),
        (["--draft-vocab", "0"], "--draft-vocab must be >= 1 or auto"),
        (["--labeller", "bundle"], "--labeller bundle labels with the exported target"),
        pytest.param(
            ["--device", "cuda"],
            "no CUDA device here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here"),
        ),
    ],
)
def test_bad_budget_input_is_one_line(tmp_path, args, fragment):
    result = CliRunner().invoke(train, [*args, "-o", str(tmp_path / "h.safetensors")])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ")
    assert fragment in lines[0] and "Traceback" not in result.output
    assert not list(tmp_path.iterdir())
