"""The online fallback: it only changes how many tokens are drafted, never the output, and it
stops drafting where drafting does not pay and resumes where it pays again.

The controller's decisions depend on timings; the tests that check decisions run the loop on a
simulated clock (every target call and draft step advances it by a set cost), so that they are
deterministic. The lossless tests run on real timings and, to reach every path, also with a
controller that plans at random.
"""

from __future__ import annotations

import random
import types
from collections import Counter

import pytest
import torch
from tiny import chi_square_pvalue, tiny_model

from mtp_edge.mtp import MTPConfig, MTPHead, init_from_target
from mtp_edge.runtime import fallback as fallback_module
from mtp_edge.runtime import loop
from mtp_edge.runtime.drafters import Draft, HybridDrafter, NgramDrafter
from mtp_edge.runtime.fallback import Fallback, StepCosts
from mtp_edge.runtime.loop import GenerationConfig, generate
from mtp_edge.runtime.mtp_drafter import mtp_drafter
from mtp_edge.runtime.sampling import SamplingParams
from mtp_edge.runtime.session import EagerSession

VOCAB = 48
PROMPT = [5, 9, 13, 7, 5, 9, 13, 21, 30, 5, 9, 13, 7, 5, 9, 13, 21, 30, 5, 9]


def random_head(target, attention: str = "none", seed: int = 0) -> MTPHead:
    from mtp_edge.mtp import cache_attention_config

    c = target.config
    extra = cache_attention_config(target, attention) if attention != "none" else {}
    config = MTPConfig(c.hidden_size, 2 * c.hidden_size, c.vocab_size, c.vocab_size, **extra)
    torch.manual_seed(seed)
    head = MTPHead(config).to(target.dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    return init_from_target(head, target, torch.arange(c.vocab_size)).eval()


class OracleDrafter:
    """Proposes the target's greedy continuation (its own copy of the weights), with every
    token corrupted while `wrong(len(context))` says so: right, wrong, or wrong for a while."""

    name = "oracle"
    needs_hidden = False

    def __init__(self, seed: int, wrong=lambda length: False, clock=None, step_cost: float = 0):
        self.oracle = EagerSession(tiny_model(seed=seed, vocab=VOCAB), 256)
        self.wrong, self.clock, self.step_cost = wrong, clock, step_cost

    def propose(self, context, hidden, k, sampler):
        tokens, out = list(context), []
        for _ in range(k):
            token = int(torch.argmax(self.oracle.forward(tokens, 0).logits[-1]))
            if self.wrong(len(context)):
                token = (token + 1) % VOCAB
            out.append(token)
            tokens.append(token)
            if self.clock is not None:
                self.clock.now += self.step_cost
        return Draft(out)

    def observe(self, context, hidden):
        pass


class Clock:
    """Simulated seconds: target calls and draft steps advance it by what they are set to cost."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class TimedSession:
    """A session whose calls of T tokens take verify(T) simulated seconds."""

    def __init__(self, session, clock: Clock, verify):
        self.session, self.clock, self.verify = session, clock, verify
        self.max_seq_len, self.max_chunk = session.max_seq_len, session.max_chunk
        self.name = session.name

    def forward(self, tokens, start, return_hidden=False):
        self.clock.now += self.verify(len(tokens))
        return self.session.forward(tokens, start, return_hidden)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    return clock


def timed_session(seed: int, clock: Clock, verify_slope: float) -> TimedSession:
    session = EagerSession(tiny_model(seed=seed, vocab=VOCAB), 256, 16)
    return TimedSession(session, clock, lambda t: 0.01 * (1 + verify_slope * (t - 1)))


def requested_per_step(monkeypatch) -> list[int]:
    """Records how many tokens the controller lets each step draft (0: a plain step)."""
    plans = []
    plan = Fallback.plan

    def recording(self, k, context):
        planned = plan(self, k, context)
        plans.append(planned[0])
        return planned

    monkeypatch.setattr(Fallback, "plan", recording)
    return plans


# --- decisions, on the simulated clock ----------------------------------------------------------


def test_an_always_wrong_drafter_is_stopped_within_a_few_steps(clock, monkeypatch):
    plans = requested_per_step(monkeypatch)
    session = timed_session(0, clock, verify_slope=0.1)
    drafter = OracleDrafter(0, wrong=lambda length: True, clock=clock, step_cost=0.0005)
    config = GenerationConfig(max_new_tokens=60, k=4, fallback=True)
    result = generate(session, PROMPT, drafter, config)
    assert result.stats.accepted_tokens == 0
    drafted = [i for i, n in enumerate(plans) if n > 0]
    assert drafted and max(drafted) <= 10  # a few steps, then plain to the end
    assert result.stats.fallback_steps >= len(plans) - 11
    assert result.stats.drafted_steps == len(drafted)


def test_drafting_resumes_when_the_drafter_becomes_right(clock, monkeypatch):
    plans = requested_per_step(monkeypatch)
    session = timed_session(1, clock, verify_slope=0.1)
    turn = len(PROMPT) + 20  # wrong for the first 20 tokens, right after
    drafter = OracleDrafter(1, wrong=lambda length: length < turn, clock=clock, step_cost=0.0005)
    config = GenerationConfig(max_new_tokens=90, k=4, fallback=True)
    result = generate(session, PROMPT, drafter, config)
    stopped = plans.index(0, 3)  # it stopped (step 0 measures a plain step first)
    resumed = next(i for i in range(stopped, len(plans)) if plans[i] > 0)
    assert resumed > stopped and 0 not in plans[resumed:]
    assert plans[-5:-1] == [4, 4, 4, 4]  # back to full drafts (the last step is cut)
    assert result.stats.accepted_tokens > 30


def test_where_drafting_pays_it_keeps_k(clock, monkeypatch):
    plans = requested_per_step(monkeypatch)
    session = timed_session(2, clock, verify_slope=0.05)
    flaky = random.Random(0)  # a few wrong drafts: acceptance ~0.8 per position
    drafter = OracleDrafter(
        2, wrong=lambda length: flaky.random() < 0.2, clock=clock, step_cost=0.0003
    )
    config = GenerationConfig(max_new_tokens=80, k=4, fallback=True)
    result = generate(session, PROMPT, drafter, config)
    assert plans[0] == 0  # the first step measures what a plain step costs
    assert plans[1] > 0  # from the prior: then full drafts (the last step is cut by the length)
    assert len(plans) > 10 and all(n == 4 for n in plans[2:-1])
    assert result.stats.fallback_steps == 1


def test_expensive_verification_shortens_drafts_and_costs_persist_per_session(clock, monkeypatch):
    """Where each extra verified token costs almost a decode, only the likeliest draft
    positions pay; the next generation on the session starts from the measured costs."""
    plans = requested_per_step(monkeypatch)
    session = timed_session(3, clock, verify_slope=0.5)
    flaky = random.Random(1)
    drafter = OracleDrafter(
        3, wrong=lambda length: flaky.random() < 0.3, clock=clock, step_cost=0.0003
    )
    config = GenerationConfig(max_new_tokens=60, k=4, fallback=True)
    generate(session, PROMPT, drafter, config)
    assert 0 < sum(plans[5:]) / len(plans[5:]) < 2  # short drafts, mostly
    costs = fallback_module.session_costs(session)
    assert costs.verify_seconds(1) == pytest.approx(0.01)  # measured, and kept for the next
    generate(session, PROMPT, drafter, config)
    assert fallback_module.session_costs(session) is costs


def test_the_controller_alone():
    costs = StepCosts()
    for width, seconds in ((1, 1.0), (1, 1.0), (5, 1.2), (5, 1.2)):
        costs.record_verify(width, seconds)
    assert costs.verify_seconds(3) == pytest.approx(1.1)  # interpolated
    assert costs.verify_seconds(6) == pytest.approx(1.2 * 1.5 / 1.4)  # by the prior slope
    stalled = StepCosts()
    for width, seconds in ((1, 1.0),) * 3 + ((5, 1.2),) * 3 + ((2, 9.0),):
        stalled.record_verify(width, seconds)
    assert stalled.verify_seconds(2) == pytest.approx(1.05)  # one slow call is not its cost
    for _ in range(3):
        stalled.record_verify(2, 9.0)
    assert stalled.verify_seconds(2) == 9.0  # four are
    assert stalled.verify_seconds(3) == 1.2  # and a wider call's is still the most it costs
    controller = Fallback(4, costs, lambda context: "model")
    costs.record_draft("model", 4, 0.04)
    assert controller.plan(4, [])[0] > 0  # the prior says drafting pays
    for _ in range(12):
        controller.record_step(4, 4, 0, 0.04, 1.2)
    assert controller.plan(4, []) == (0, False)  # a model drafter (1% per token) shadows later
    shadows = [controller.plan(4, [])[1] for _ in range(3)]
    assert shadows == [True, False, False]  # after FIRST_PROBE_INTERVAL plain steps
    controller.start_shadow([20, 99, 22, 23], 20)
    controller.check_shadow(list(range(21)))  # 20 arrived: the first shadow token was right
    assert controller.shadow and controller.observed["model"][1] is None
    controller.check_shadow(list(range(22)))  # 21 arrived: the second was wrong, the end
    observed = controller.observed["model"]
    assert controller.shadow == [] and observed[0] > observed[1]


def test_sources_are_judged_apart():
    """A free, right lookup keeps drafting where the model's drafts stopped paying; while the
    lookup is silent, plain steps shadow nothing (a model drafter shadows at intervals)."""
    costs = StepCosts()
    for width in (1, 1, 5, 5):
        costs.record_verify(width, 1.0 + 0.05 * (width - 1))
    costs.record_draft("model", 4, 0.12)
    costs.record_draft("lookup", 4, 0.0001)
    hits = {"now": False}
    controller = Fallback(4, costs, lambda context: "lookup" if hits["now"] else "model")
    for _ in range(12):
        assert controller.plan(4, [])[0] >= 0
        controller.record_step(4, 4, 0, 0.12, 1.2)  # the model's drafts: all wrong
    assert controller.plan(4, [])[0] == 0
    hits["now"] = True
    for _ in range(8):
        planned, shadow = controller.plan(4, [])
        assert planned > 0 and not shadow
        controller.record_step(planned, planned, planned, 0.0001, 1.2)  # the lookup's: right
    assert controller.plan(4, []) == (4, False)
    assert controller.acceptance("lookup")[0] > 0.8 > 0.1 > controller.acceptance("model")[0]
    cheap = Fallback(4, costs, lambda context: "lookup")
    cheap.observed["lookup"] = [0.0] * 4
    assert cheap.plan(4, []) == (0, True)  # free to shadow: every plain step does


# --- lossless, on real timings -----------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=4, vocab=VOCAB)


def drafters(model, kind: str):
    if kind == "ngram":
        return NgramDrafter(max_n=3, min_n=1)
    head = random_head(model, attention="self" if kind == "mtp-self" else "none", seed=5)
    mtp = mtp_drafter(head, model)
    return HybridDrafter(mtp, max_n=3, min_match=2) if kind == "mtp+ngram" else mtp


def random_plans(monkeypatch, seed: int) -> None:
    """The controller plans at random (any length, plain steps, shadows): the loop must stay
    lossless whatever it is told."""
    rng = random.Random(seed)
    monkeypatch.setattr(
        Fallback, "plan", lambda self, k, context: (rng.randint(0, k), rng.random() < 0.3)
    )


@pytest.mark.parametrize("kind", ["ngram", "mtp", "mtp-self", "mtp+ngram"])
@pytest.mark.parametrize("planner", ["measured", "random"])
def test_greedy_output_is_the_same_with_and_without_the_fallback(
    target, kind, planner, monkeypatch
):
    if planner == "random":
        random_plans(monkeypatch, seed=len(kind))
    prompts = [PROMPT, [3, 1, 4, 1, 5, 9, 2, 6], PROMPT[:7] * 3]
    for prompt in prompts:
        session = EagerSession(target, 160, 16)
        outputs = []
        for drafter, fallback in ((None, False), (drafters(target, kind), False)):
            config = GenerationConfig(max_new_tokens=50, k=4, fallback=fallback)
            outputs.append(generate(session, prompt, drafter, config))
        on = generate(
            session, prompt, drafters(target, kind), GenerationConfig(50, 4, fallback=True)
        )
        plain, off = outputs
        assert off.token_ids == plain.token_ids == on.token_ids
        assert on.stop_reason == plain.stop_reason
        s = on.stats
        assert s.drafted_steps + s.fallback_steps <= s.verify_steps
        if planner == "random":
            assert s.fallback_steps > 0


def test_executorch_greedy_output_is_the_same_with_and_without_the_fallback(
    monkeypatch, tmp_path_factory
):
    """On an exported program (quantized: verify and single steps round the same way only where
    the kernel is row-exact, which is what lossless there rests on)."""
    from test_executorch import PROMPT as ET_PROMPT
    from test_executorch import programs_in, session

    programs_in(tmp_path_factory)

    program = session("8da8w-cw")
    results = {}
    for name, drafter, fallback in (
        ("plain", None, False),
        ("off", NgramDrafter(), False),
        ("on", NgramDrafter(), True),
    ):
        results[name] = generate(
            program, ET_PROMPT, drafter, GenerationConfig(48, 4, fallback=fallback)
        )
    random_plans(monkeypatch, seed=7)
    results["random"] = generate(
        program, ET_PROMPT, NgramDrafter(), GenerationConfig(48, 4, fallback=True)
    )
    tokens = {name: r.token_ids for name, r in results.items()}
    assert tokens["off"] == tokens["plain"] == tokens["on"] == tokens["random"]
    assert results["on"].stats.drafted_tokens > 0


def test_the_flag_and_its_default(tmp_path, monkeypatch):
    """mtp-run drafts every step by default and with --no-fallback, and falls back with
    --fallback, greedy or sampling; greedy tokens never change."""
    import json

    from click.testing import CliRunner
    from tiny import hf_reference, save_hf_dir

    from mtp_edge.cli import run

    model = save_hf_dir(hf_reference("llama", seed=3), tmp_path / "tiny")
    plans = requested_per_step(monkeypatch)
    args = ["-m", str(model), "-p", "the cat the cat the", "--no-chat-template", "-n", "24"]
    args += ["--drafter", "ngram", "--json", "-"]

    def tokens_and_plans(*extra) -> tuple[list[int], int]:
        plans.clear()
        result = CliRunner().invoke(run, [*args, *extra])
        assert result.exit_code == 0, result.output
        out = json.loads(result.stdout)
        assert {"drafted_steps", "fallback_steps"} <= set(out["stats"])
        return out["token_ids"], len(plans)

    greedy, planned = tokens_and_plans("--fallback")
    assert planned > 0
    assert tokens_and_plans() == (greedy, 0)
    assert tokens_and_plans("--no-fallback") == (greedy, 0)
    assert tokens_and_plans("--drafter", "none")[0] == greedy
    sampling = ["--temperature", "0.8", "--seed", "5"]
    sampled, planned = tokens_and_plans(*sampling)
    assert planned == 0 and tokens_and_plans(*sampling) == (sampled, 0)
    assert tokens_and_plans(*sampling, "--fallback")[1] > 0


# --- sampling ----------------------------------------------------------------------------------

SAMPLE_VOCAB, NEW, SAMPLE_PROMPT, SAMPLES = 4, 3, [1, 2, 3], 2000


def test_sampling_keeps_the_target_distribution(monkeypatch):
    """Temperature sampling with plans at random (plain steps and shadow drafts draw from the
    same generator): the sequences still follow the target's distribution exactly."""
    import itertools

    from mtp_edge.runtime.sampling import Sampler

    random_plans(monkeypatch, seed=3)
    model = tiny_model(seed=11, vocab=SAMPLE_VOCAB, hidden_size=16, num_layers=1)
    session = EagerSession(model, 32)
    params = dict(temperature=0.9, top_k=3)
    sampler = Sampler(SamplingParams(**params))
    dist = {}
    for seq in itertools.product(range(SAMPLE_VOCAB), repeat=NEW):
        logits = session.forward(SAMPLE_PROMPT + list(seq[:-1]), 0).logits[len(SAMPLE_PROMPT) - 1 :]
        probs = sampler.probs(logits)
        dist[seq] = float(torch.prod(probs[torch.arange(NEW), torch.tensor(seq)]))
    head = random_head(model, seed=3)
    counts: Counter = Counter()
    drafted = 0
    for seed in range(SAMPLES):
        drafter = mtp_drafter(head, model)
        config = GenerationConfig(
            NEW, k=2, sampling=SamplingParams(seed=seed, **params), fallback=True
        )
        result = generate(session, SAMPLE_PROMPT, drafter, config)
        counts[tuple(result.token_ids)] += 1
        drafted += result.stats.drafted_tokens
    assert drafted > SAMPLES // 4  # drafts were verified, not only shadowed
    assert chi_square_pvalue(counts, dist, SAMPLES) > 1e-3
