"""The native C++ runtime (one file past 600 lines: every test shares the module's runner build
and exported bundles, minutes to make). runtime/native builds with cmake here, its C++ unit
tests pass, and on real exported bundles its runner produces the same tokens as the Python
runtime, for every drafter (none, ngram, mtp, draft-lm, and the hybrids mtp+ngram /
draft-lm+ngram), greedy,
over the built-in prompt suite; MTP heads of all three kinds: heads that read the target's cache
(the `draft` method of the target's program, on its cache), MLP heads (a drafter program of their
own) and self-attending heads (a drafter program with a cache of its own, fed the verified rows);
for the hybrids and self heads also the same drafts at every verify step.

The native build registers its own kernels for ExecuTorch's llama cache ops (the pip wheel has
them only inside its Python extension), so its attention rounds differently from the Python
runtime's: tokens may differ only where the Python plain run's two best logits nearly tie, as
for speculative vs plain decoding (devices/harness.py NEAR_TIE)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import cache_home_sharing_kernels, setup_options, without_drafting_policy

from mtp_edge.devices.harness import NEAR_TIE, load_prompts
from mtp_edge.runtime import native_runner
from mtp_edge.runtime.bundle import bundle_drafter, open_bundle, target_session
from mtp_edge.runtime.drafters import HybridDrafter, NgramDrafter
from mtp_edge.runtime.loop import GenerationConfig, first_divergence, generate
from mtp_edge.runtime.mtp_drafter import MtpDrafter

MAX_NEW_TOKENS = 24
PROMPT_TOKENS = 160  # the tail of each built-in prompt in the tiny tokenizer (context is 256)


@pytest.fixture(scope="module")
def runner(host_runner):
    return host_runner


@pytest.fixture(scope="module", autouse=True)
def verified_stamps(tmp_path_factory):
    """The readers' verified-once stamps go to a cache of the tests' own, not the user's (the
    compiled attention kernel is shared with the user's cache)."""
    cache = cache_home_sharing_kernels(tmp_path_factory.mktemp("cache"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache))
        patch.delenv("MTP_EDGE_VERIFY", raising=False)
        yield


def unpoliced(tmp_path_factory, bundle: Path) -> str:
    """A copy of one of conftest.py's shared MTP bundles (a tiny llama with a chat template,
    256 positions, 8da8w, random heads with their attention amplified) without a drafting
    policy, as `--ngram-sizes none --draft-confidence 0` exports it: the bundle's drafter runs
    alone, ungated, unless a test sets a policy (test_bundle_drafting_policy_matches_python)."""
    copy = tmp_path_factory.mktemp("native") / "bundle"
    shutil.copytree(bundle, copy)
    without_drafting_policy(copy)
    return str(copy)


@pytest.fixture(scope="module")
def mtp_bundle(mtp_bundle_of, tmp_path_factory):
    """An 8da8w target with random MTP heads (lossless needs no good drafts) that read the
    target's cache (the default kind): the target program's `draft` method, no drafter.pte."""
    bundle = unpoliced(tmp_path_factory, mtp_bundle_of("target_cache"))
    m = open_bundle(bundle).manifest
    assert m.drafter.method == "draft" and m.drafter.reads_target_cache
    assert "drafter" not in m.models and "draft" in m.models["target"].methods
    assert m.drafter.lookup is None and m.drafter.draft_confidence == 0
    return bundle


@pytest.fixture(scope="module")
def mlp_mtp_bundle(mtp_bundle_of, tmp_path_factory):
    """The same with MLP heads (attention "none"): a drafter.pte program of their own."""
    bundle = unpoliced(tmp_path_factory, mtp_bundle_of("none"))
    m = open_bundle(bundle).manifest
    assert m.drafter.method is None and "drafter" in m.models
    return bundle


@pytest.fixture(scope="module")
def self_mtp_bundle(mtp_bundle_of, tmp_path_factory):
    """The same with self-attending (EAGLE-style) heads: a drafter.pte with a KV cache of its
    own, fed the rows the target verified in chunks of at most max_chunk (128 < the 160-token
    prompts), then one drafted token per step. The drafter in fp32 (the target stays 8da8w):
    the random head's draft logits often nearly tie (16% of its drafts within 0.02), and with
    8-bit activations the runtimes' rounding flips some of them, so that draft-by-draft
    comparison would have to excuse differences as large as those of a broken rule (a step
    whose rows the head never took in); in fp32 the runtimes draft alike exactly."""
    bundle = unpoliced(tmp_path_factory, mtp_bundle_of("self"))
    m = open_bundle(bundle).manifest
    assert m.drafter.own_cache and m.drafter.max_chunk == 128 < PROMPT_TOKENS
    assert m.drafter.method is None and "drafter" in m.models
    assert m.models["drafter"].quant["scheme"] == "fp32"
    return bundle


@pytest.fixture(scope="module")
def draft_lm_bundle(draft_lm_bundle_256):
    """An 8da4w target with a draft model of the same vocabulary: the target's own weights, so
    that drafts are often right (a random draft model never is). conftest.py's, shared."""
    return str(draft_lm_bundle_256)


def suite_ids(bundle_dir: str) -> list[tuple[str, str, list[int]]]:
    """The built-in prompts as the Python runtime encodes them (chat format, bos), tails."""
    tokenizer = open_bundle(bundle_dir).tokenizer
    rows = []
    for p in load_prompts():
        ids = tokenizer.encode_prompt(p.prompt, chat=True)
        rows.append((p.id, p.category, ids[-PROMPT_TOKENS:]))
    return rows


def run_native(runner, bundle_dir, prompts, tmp_path, *extra) -> dict:
    path = tmp_path / "prompts.jsonl"
    lines = [
        json.dumps({"id": i, "category": c, "prompt_ids": ids, "max_new_tokens": MAX_NEW_TOKENS})
        for i, c, ids in prompts
    ]
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "report.json"
    args = [str(runner), "--bundle", bundle_dir, "--prompts", str(path), "--json", str(out)]
    done = subprocess.run([*args, *extra], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


def assert_same_tokens(python_runs, native_ids, what: str):
    """Identical, or first different where the Python run's two best logits nearly tie."""
    for (prompt_id, result), ids in zip(python_runs, native_ids, strict=True):
        j = first_divergence(result.token_ids, ids)
        if j is not None:
            gap = result.top2_gaps[j] if j < len(result.top2_gaps) else None
            assert gap is not None and gap < NEAR_TIE, (
                f"{what}, prompt {prompt_id}: native differs from Python at token {j} "
                f"(top-2 gap {gap}): {result.token_ids} vs {ids}"
            )


def python_runs(
    bundle_dir,
    prompts,
    drafter,
    adaptive_k=False,
    confidence=0.0,
    stop_strings=(),
    ngram_sizes=None,
    drafts=None,
) -> list:
    """Python's generate on each prompt. drafter "bundle": the bundle's own; with ngram_sizes
    (MIN, MAX) it becomes "<drafter>+ngram", HybridDrafter as runtime/assemble.py builds it; a list
    `drafts` receives, per prompt, DraftRecorder's record of each step's draft."""
    bundle = open_bundle(bundle_dir)
    session = target_session(bundle)
    m = bundle.manifest
    config = GenerationConfig(
        max_new_tokens=MAX_NEW_TOKENS,
        k=4,
        adaptive_k=adaptive_k,
        eos_ids=tuple(m.eos_ids),
        stop_strings=tuple(stop_strings),
    )
    if drafter == "bundle":
        drafter = bundle_drafter(bundle, confidence)
    if ngram_sizes is not None:
        drafter = HybridDrafter(drafter, max_n=ngram_sizes[1], min_match=ngram_sizes[0])
    if drafts is not None:
        drafter = DraftRecorder(drafter, drafts)
    detokenize = bundle.tokenizer.decode
    runs = []
    for i, _, ids in prompts:
        if drafts is not None:
            drafts.append([])
        runs.append((i, generate(session, ids, drafter, config, detokenize)))
    return runs


class DraftRecorder:
    """A Python drafter, recorded: appends to steps[-1], for each verify step, (the tokens the
    target verified; for an MTP head's draft, at each token the gap between its draft logits'
    two best and the runner-up token, None for a lookup's or a draft model's draft; whether a
    hybrid's lookup drafted)."""

    def __init__(self, drafter, steps: list):
        self.drafter, self.steps = drafter, steps
        self.name, self.needs_hidden = drafter.name, drafter.needs_hidden
        self.gaps = None
        self.hybrid = drafter if isinstance(drafter, HybridDrafter) else None
        if hasattr(drafter, "source"):  # the fallback measures a hybrid's sources apart
            self.source = drafter.source
        head = drafter.model if self.hybrid else drafter
        if isinstance(head, MtpDrafter):
            step_fn, ids = head.step_fn, head.draft_ids

            def step(h, tokens, position):
                logits, next_h = step_fn(h, tokens, position)
                if self.gaps is not None:
                    top2 = torch.topk(logits[0].float(), 2)
                    gap = float(top2.values[0] - top2.values[1])
                    self.gaps.append((gap, int(ids[top2.indices[1]])))
                return logits, next_h

            head.step_fn = step

    def propose(self, context, hidden, k, sampler):
        lookups = self.hybrid.from_lookup if self.hybrid else 0
        self.gaps = []
        draft = self.drafter.propose(context, hidden, k, sampler)
        gaps, self.gaps = self.gaps, None
        lookup = (self.hybrid.from_lookup if self.hybrid else 0) > lookups
        if k > 0:  # the loop also asks for 0 tokens (to keep a head's state), as a step without
            # a draft, which the runner does not report
            self.steps[-1].append(
                (list(draft.tokens[:k]), None if lookup or not gaps else gaps, lookup)
            )
        return draft

    def observe(self, context, hidden):
        self.drafter.observe(context, hidden)


def same_drafts(python_steps, native_steps, what: str, tie: float = NEAR_TIE) -> bool:
    """Step by step the same drafts: True; False where a model draft first differs at a token
    that is the runner-up of the Python run's draft logits, within `tie` of the best (the
    runtimes' kernels round differently, see the module doc), after which the runs may go apart
    and are not compared further."""
    for j, ((tokens, gaps, _), ours) in enumerate(zip(python_steps, native_steps, strict=False)):
        if ours != tokens:
            i = first_divergence(tokens, ours)
            gap, second = gaps[i] if gaps is not None and i < len(gaps) else (None, None)
            runner_up = i < len(ours) and ours[i] == second
            assert gap is not None and gap < tie and runner_up, (
                f"{what}: step {j} drafts {ours} natively, {tokens} in Python (their draft "
                f"logits' two best differ by {gap}, runner-up {second})"
            )
            return False
    assert len(python_steps) == len(native_steps), what
    return True


def test_cpp_unit_tests(runner):
    done = subprocess.run(
        [str(native_runner.UNIT_TESTS)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "all native core tests passed" in done.stdout


@pytest.mark.parametrize(
    "bundle_name, drafter",
    [("mtp_bundle", "ngram"), ("mtp_bundle", "mtp"), ("mlp_mtp_bundle", "mtp")],
)
def test_runner_equals_python_mtp_bundle(request, runner, tmp_path, bundle_name, drafter):
    mtp_bundle = request.getfixturevalue(bundle_name)
    prompts = suite_ids(mtp_bundle)
    report = run_native(runner, mtp_bundle, prompts, tmp_path, "--drafter", drafter)
    assert report["drafter"] == drafter and report["backend"] == "executorch"
    assert report["summary"]["prompts"] == len(prompts) == 48
    rows = report["prompts"]
    plain = python_runs(mtp_bundle, prompts, None)
    assert_same_tokens(plain, [r["ar_token_ids"] for r in rows], "plain")
    spec = python_runs(mtp_bundle, prompts, NgramDrafter() if drafter == "ngram" else "bundle")
    assert_same_tokens(spec, [r["spec_token_ids"] for r in rows], drafter)
    assert report["summary"]["lossless"]
    assert sum(r["verify_steps"] for r in rows) < sum(r["spec_tokens"] for r in rows)  # drafts hit
    for r, (_, result) in zip(rows, spec, strict=True):
        assert r["stop_reason_spec"] == result.stop_reason or not r["identical"]
        # Same tokens in the same verify steps: the same drafts (lossless decoding alone would
        # give the same tokens from any drafts, e.g. a draft method on a cache of its own).
        if first_divergence(result.token_ids, r["spec_token_ids"]) is None:
            assert r["verify_steps"] == result.stats.verify_steps, r["id"]
            assert r["acceptance_rate"] == pytest.approx(result.stats.acceptance_rate, abs=1e-4)


def test_bundle_drafting_policy_matches_python(runner, mlp_mtp_bundle, tmp_path):
    """A bundle's drafting policy (manifest drafter.lookup and draft_confidence, which
    mtp-export writes) is what both runtimes run by default: native mtp-runner with no
    --drafter against runtime/assemble.py's default drafter (mtp+ngram, gated), same tokens,
    same drafts; and flags still win over it."""

    from mtp_edge.runtime.assemble import assemble

    bundle = tmp_path / "policy"
    shutil.copytree(mlp_mtp_bundle, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["drafter"].update(lookup="2-3", draft_confidence=0.05)
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2))
    prompts = suite_ids(str(bundle))[:16]
    report = run_native(runner, str(bundle), prompts, tmp_path, "--record-drafts")
    assert report["drafter"] == "mtp+ngram"
    policy = assemble(setup_options(bundle, 256)).drafter
    assert (policy.lookup.min_n, policy.lookup.max_n, policy.model.min_confidence) == (2, 3, 0.05)
    drafts: list = []
    spec = python_runs(str(bundle), prompts, policy, drafts=drafts)
    rows = report["prompts"]
    assert_same_tokens(spec, [r["spec_token_ids"] for r in rows], "policy")
    assert policy.from_lookup > 0
    gated = sum(1 for steps in drafts for tokens, *_ in steps if not tokens)
    assert gated > 0  # the floor stopped some drafts
    for r, steps in zip(rows, drafts, strict=True):
        assert same_drafts(steps, r["spec_drafts"], f"policy {r['id']}")
    told = run_native(runner, str(bundle), prompts[:2], tmp_path,
                      "--ngram-sizes", "1-1", "--draft-confidence", "0")  # fmt: skip
    assert told["drafter"] == "mtp+ngram"


@pytest.mark.parametrize(
    "bundle_name, drafter, sizes, count, tie",
    [
        ("self_mtp_bundle", "mtp", None, 48, 1e-4),  # fp32 drafter: ties at float rounding
        ("self_mtp_bundle", "mtp+ngram", (1, 3), 48, 1e-4),
        ("mlp_mtp_bundle", "mtp+ngram", (2, 4), 48, NEAR_TIE),
        ("draft_lm_bundle", "draft-lm+ngram", (1, 3), 16, NEAR_TIE),
    ],
)
def test_runner_drafts_equal_python(
    request, runner, tmp_path, bundle_name, drafter, sizes, count, tie
):
    """Self heads and the hybrid drafters: the runner drafts what Python drafts, step by step
    (the random heads' drafts are almost never accepted, so equal tokens and verify steps would
    not show it), and generates the same tokens in the same verify steps. For X+ngram the lookup
    drafts where it finds the context's last MIN..MAX tokens earlier, the model elsewhere, and a
    self head still takes in the rows of the lookup's steps (observe)."""
    bundle = request.getfixturevalue(bundle_name)
    prompts = suite_ids(bundle)[:count]
    options = ["--drafter", drafter, "--record-drafts"]
    if sizes is not None:
        options += ["--ngram-sizes", f"{sizes[0]}-{sizes[1]}"]
    report = run_native(runner, bundle, prompts, tmp_path, *options)
    assert report["drafter"] == drafter
    rows = report["prompts"]
    if sizes is None:
        plain = python_runs(bundle, prompts, None)
        assert_same_tokens(plain, [r["ar_token_ids"] for r in rows], "plain")
    drafts: list = []
    spec = python_runs(bundle, prompts, "bundle", ngram_sizes=sizes, drafts=drafts)
    assert_same_tokens(spec, [r["spec_token_ids"] for r in rows], drafter)
    assert report["summary"]["lossless"]
    compared = 0
    for r, (_, result), steps in zip(rows, spec, drafts, strict=True):
        what = f"{bundle_name} {drafter}, prompt {r['id']}"
        if not same_drafts(steps, r["spec_drafts"], what, tie):
            continue
        compared += 1
        assert r["spec_token_ids"] == result.token_ids, what
        assert r["stop_reason_spec"] == result.stop_reason, what
        assert r["verify_steps"] == result.stats.verify_steps, what
        assert r["acceptance_rate"] == pytest.approx(result.stats.acceptance_rate, abs=1e-4)
    assert compared >= count * 7 // 8, f"only {compared} of {count} prompts drafted alike"
    lookups = [lookup for steps in drafts for _, _, lookup in steps]
    if sizes is not None:  # both drafters of the hybrid drafted; the lookup's drafts were kept
        assert any(lookups) and not all(lookups)
        assert report["summary"]["acceptance_rate"] > 0


@pytest.mark.parametrize("bundle_name", ["mtp_bundle", "mlp_mtp_bundle", "draft_lm_bundle"])
def test_adaptive_k_and_draft_confidence_match_python(request, runner, tmp_path, bundle_name):
    """The same steps as Python with k adapting and drafting stopped at low confidence."""
    bundle = request.getfixturevalue(bundle_name)
    prompts = suite_ids(bundle)[::6]
    options = ["--adaptive-k", "--draft-confidence", "0.3"]
    report = run_native(runner, bundle, prompts, tmp_path, *options)
    rows = report["prompts"]
    spec = python_runs(bundle, prompts, "bundle", adaptive_k=True, confidence=0.3)
    assert_same_tokens(spec, [r["spec_token_ids"] for r in rows], f"{bundle_name} adaptive")
    for r, (_, result) in zip(rows, spec, strict=True):
        if first_divergence(result.token_ids, r["spec_token_ids"]) is None:
            assert r["verify_steps"] == result.stats.verify_steps
            assert r["acceptance_rate"] == pytest.approx(result.stats.acceptance_rate, abs=1e-4)


@pytest.mark.parametrize("bundle_name", ["mtp_bundle", "self_mtp_bundle"])
def test_mtp_draft_method_at_the_end_of_the_cache(request, runner, tmp_path, bundle_name):
    """Prompts that fill the context: the draft method (or a self head, in its own cache) writes
    cache slots up to the last ones (k shrinks to the room left), and both runtimes stop on a
    full context with the same tokens."""
    mtp_bundle = request.getfixturevalue(bundle_name)
    tails = [ids for _, _, ids in suite_ids(mtp_bundle)[:6]]
    prompts = [(f"p{i}", "c", (tails[i] + tails[i + 1])[-(244 + i) :]) for i in range(5)]
    report = run_native(runner, mtp_bundle, prompts, tmp_path)
    rows = report["prompts"]
    spec = python_runs(mtp_bundle, prompts, "bundle")
    assert_same_tokens(spec, [r["spec_token_ids"] for r in rows], "mtp at the cache end")
    assert any(result.stop_reason == "context_full" for _, result in spec)
    for r, (_, result) in zip(rows, spec, strict=True):
        assert r["stop_reason_spec"] == result.stop_reason or not r["identical"]


def test_runner_equals_python_draft_lm_bundle(runner, draft_lm_bundle, tmp_path):
    prompts = suite_ids(draft_lm_bundle)[:16]
    report = run_native(runner, draft_lm_bundle, prompts, tmp_path)
    assert report["drafter"] == "draft-lm"
    rows = report["prompts"]
    assert_same_tokens(
        python_runs(draft_lm_bundle, prompts, None), [r["ar_token_ids"] for r in rows], "plain"
    )
    spec = python_runs(draft_lm_bundle, prompts, "bundle")
    assert_same_tokens(spec, [r["spec_token_ids"] for r in rows], "draft-lm")
    assert report["summary"]["acceptance_rate"] > 0


@pytest.mark.parametrize("bundle_name", ["mtp_bundle", "self_mtp_bundle"])
def test_runner_text_prompts_and_c_api_match_python(request, runner, tmp_path, bundle_name):
    """Text prompts go through the native tokenizer and the manifest's chat format; the C API
    streams text that adds up to its result, and generates what the Python runtime does (with
    the bundle's own drafter: the C API opens bundles so), in the same verify steps."""
    mtp_bundle = request.getfixturevalue(bundle_name)
    text = "the cat sat on the mat. the cat sat on the"
    bundle = open_bundle(mtp_bundle)
    assert bundle.manifest.chat_format is not None
    ids = bundle.tokenizer.encode_prompt(text, chat=True)
    [(_, expected)] = python_runs(mtp_bundle, [("p", "c", ids)], "bundle")
    options = json.dumps({"max_new_tokens": MAX_NEW_TOKENS, "k": 4})
    done = subprocess.run(
        [str(native_runner.UNIT_TESTS), mtp_bundle, text, options],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result_line, streamed = done.stdout.split("\n", 1)
    result = json.loads(result_line)
    assert result["prompt_tokens"] == len(ids)
    assert_same_tokens([("p", expected)], [result["token_ids"]], "C API")
    assert result["drafter"] == "mtp"
    if result["token_ids"] == expected.token_ids:
        for key in ("verify_steps", "drafted_tokens", "accepted_tokens"):
            assert result["stats"][key] == getattr(expected.stats, key), key
    assert streamed[:-1] == result["text"] == bundle.tokenizer.decode(result["token_ids"])

    done = subprocess.run(
        [str(runner), "--bundle", mtp_bundle, "--prompt", text, "--max-new-tokens", "24"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)["prompts"][0]
    assert row["prompt_tokens"] == len(ids)
    assert_same_tokens([("p", expected)], [row["spec_token_ids"]], "runner text prompt")


NEVER = "\u2603 never generated"  # a second --stop that the tiny models do not produce


def stop_point(decode, result, k: int = 4) -> tuple[int, str] | None:
    """A stop string taken from a plain run's text that ends generation at token n, mid-way
    (the latest n in 8..20): the shortest tail of the text of the first n tokens that the text
    of the first n - 1 does not contain. None where a near-tie up to the last verify step could
    let the runtimes differ, or the text ends inside a character."""
    for n in range(20, 7, -1):
        text, before = decode(result.token_ids[:n]), decode(result.token_ids[: n - 1])
        if min(result.top2_gaps[: n + k + 1]) < NEAR_TIE or "\ufffd" in text:
            continue
        for size in range(3, len(text) + 1):
            if text[-size:] not in before:
                return n, text[-size:]
    return None


@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
def test_stop_strings_match_python(runner, mtp_bundle, tmp_path, drafter):
    """--stop (repeatable): the runner stops where the Python loop does, on the token whose text
    completes a stop string, plain and speculative (accepted drafts past it are dropped), with
    the same ids, verify steps, acceptance and stop_reason."""
    decode = open_bundle(mtp_bundle).tokenizer.decode
    prompts = suite_ids(mtp_bundle)
    chosen = []
    for prompt, (_, result) in zip(prompts, python_runs(mtp_bundle, prompts, None), strict=True):
        point = stop_point(decode, result)
        if point is not None:
            chosen.append((prompt, *point))
    assert len(chosen) >= 4, "too few prompts without near-ties for the test"
    dropped = 0
    for prompt, n, stop in chosen[:: len(chosen) // 4][:4]:
        report = run_native(
            runner,
            mtp_bundle,
            [prompt],
            tmp_path,
            "--drafter",
            drafter,
            "--stop",
            stop,
            "--stop",
            NEVER,
        )
        [row] = report["prompts"]
        stops = (stop, NEVER)
        [(_, plain)] = python_runs(mtp_bundle, [prompt], None, stop_strings=stops)
        spec_drafter = NgramDrafter() if drafter == "ngram" else "bundle"
        [(_, spec)] = python_runs(mtp_bundle, [prompt], spec_drafter, stop_strings=stops)
        what = f"{prompt[0]}, stop {stop!r} at token {n}"
        assert plain.stop_reason == spec.stop_reason == "stop_string", what
        assert len(plain.token_ids) == n and spec.token_ids == plain.token_ids, what
        assert row["ar_token_ids"] == plain.token_ids, what
        assert row["spec_token_ids"] == spec.token_ids, what
        assert row["stop_reason_ar"] == row["stop_reason_spec"] == "stop_string", what
        assert row["verify_steps"] == spec.stats.verify_steps, what
        assert row["acceptance_rate"] == pytest.approx(spec.stats.acceptance_rate, abs=1e-4)
        # Tokens the verify steps accepted beyond the one completing the stop string.
        dropped += 1 + spec.stats.verify_steps + spec.stats.accepted_tokens - n
    if drafter == "ngram":
        assert dropped > 0  # some run stopped in the middle of a verify step's tokens


def test_c_api_stop_strings_match_python(runner, mtp_bundle):
    """The C API's options {"stop_strings": [...]}: Python's tokens and stop_reason; its text
    ends before the stop string, as mtp-run's."""
    bundle = open_bundle(mtp_bundle)
    decode = bundle.tokenizer.decode
    text = "the cat sat on the mat. the cat sat on the"
    ids = bundle.tokenizer.encode_prompt(text, chat=True)
    [(_, whole)] = python_runs(mtp_bundle, [("p", "c", ids)], "bundle")
    n, stop = stop_point(decode, whole)
    [(_, expected)] = python_runs(mtp_bundle, [("p", "c", ids)], "bundle", stop_strings=[stop])
    assert len(expected.token_ids) == n and expected.stop_reason == "stop_string"
    options = {"max_new_tokens": MAX_NEW_TOKENS, "k": 4, "stop_strings": [NEVER, stop]}
    done = subprocess.run(
        [str(native_runner.UNIT_TESTS), mtp_bundle, text, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.split("\n", 1)[0])
    assert result["token_ids"] == expected.token_ids
    assert result["stop_reason"] == "stop_string"
    full_text = decode(expected.token_ids)
    assert result["text"] == full_text[: full_text.index(stop)]


@pytest.fixture(scope="module")
def policy_mtp_bundle(mtp_bundle, tmp_path_factory):
    """mtp_bundle with a drafting policy (lookup 2-3): its own drafter is mtp+ngram, so that
    the C API's drafters chosen by name all differ from the one it runs by default."""

    bundle = tmp_path_factory.mktemp("policy") / "bundle"
    shutil.copytree(mtp_bundle, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["drafter"]["lookup"] = "2-3"
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return str(bundle)


def c_api(bundle_dir: str, text: str, options: dict) -> subprocess.CompletedProcess:
    """tests/test_core.cpp's C API run: mtp_generate(text, options) on the bundle."""
    return subprocess.run(
        [str(native_runner.UNIT_TESTS), bundle_dir, text, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "named, drafter, sizes, confidence",
    [
        ({}, "mtp+ngram", (2, 3), 0.0),  # none named: the bundle's own, with its policy
        ({"drafter": "ngram"}, "ngram", None, 0.0),
        ({"drafter": "mtp"}, "mtp", None, 0.0),
        (
            {"drafter": "mtp+ngram", "ngram_sizes": "1-2", "draft_confidence": 0.3},
            "mtp+ngram",
            (1, 2),
            0.3,
        ),
    ],
)
def test_c_api_drafter_by_name(runner, policy_mtp_bundle, named, drafter, sizes, confidence):
    """The C API's options {"drafter": NAME, "ngram_sizes", "draft_confidence"}: the named
    drafter drafts (the verify steps and drafts of Python's run with that drafter), the result
    names it, and greedy decoding stays lossless (the tokens of plain decoding, which
    "speculative": false still means whatever drafter is named)."""
    bundle = open_bundle(policy_mtp_bundle)
    text = "the cat sat on the mat. the cat sat on the"
    ids = bundle.tokenizer.encode_prompt(text, chat=True)
    base = {"max_new_tokens": MAX_NEW_TOKENS, "k": 4}
    done = c_api(policy_mtp_bundle, text, {**base, **named, "speculative": False})
    assert done.returncode == 0, done.stderr
    plain = json.loads(done.stdout.split("\n", 1)[0])
    assert plain["drafter"] == "none" and plain["stats"]["drafted_tokens"] == 0
    done = c_api(policy_mtp_bundle, text, {**base, **named})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.split("\n", 1)[0])
    assert result["drafter"] == drafter
    [(_, python_plain)] = python_runs(policy_mtp_bundle, [("p", "c", ids)], None)
    j = first_divergence(plain["token_ids"], result["token_ids"])
    assert j is None or python_plain.top2_gaps[j] < NEAR_TIE, (plain, result)
    spec = NgramDrafter() if drafter == "ngram" else "bundle"
    [(_, expected)] = python_runs(
        policy_mtp_bundle, [("p", "c", ids)], spec, confidence=confidence, ngram_sizes=sizes
    )
    assert_same_tokens([("p", expected)], [result["token_ids"]], f"C API {drafter}")
    assert result["stats"]["drafted_tokens"] > 0
    if result["token_ids"] == expected.token_ids:
        for key in ("verify_steps", "drafted_tokens", "accepted_tokens"):
            assert result["stats"][key] == getattr(expected.stats, key), key


def test_c_api_refuses_drafters_the_bundle_cannot_serve(runner, mtp_bundle):
    """An unknown drafter, or one the bundle does not carry: mtp_generate fails with one line
    that names the drafters the bundle takes."""
    accepted = "takes none, ngram, mtp or mtp+ngram"
    for name, why in [
        ("warp", "unknown drafter 'warp'"),
        ("draft-lm", "drafter 'draft-lm': this bundle carries a 'mtp' drafter"),
        ("draft-lm+ngram", "drafter 'draft-lm': this bundle carries a 'mtp' drafter"),
        ("none+ngram", "drafter 'none+ngram': name a model drafter before +ngram"),
        ("bundle", "unknown drafter 'bundle'"),  # not a name mtp-run takes
    ]:
        done = c_api(mtp_bundle, "hello", {"max_new_tokens": 2, "drafter": name})
        assert done.returncode == 1, done.stdout
        [line] = [x for x in done.stderr.splitlines() if x.startswith("mtp_generate: ")]
        assert why in line and line.endswith(accepted), line


def test_same_seed_same_samples(runner, mtp_bundle, tmp_path):
    """Sampling draws from the native runtime's own seeded generator: the same seed repeats the
    samples exactly; they are not the Python runtime's samples (torch's generator)."""
    prompts = suite_ids(mtp_bundle)[:4]

    def sampled(seed: int) -> list:
        options = ["--temperature", "0.9", "--top-p", "0.95", "--seed", str(seed)]
        report = run_native(runner, mtp_bundle, prompts, tmp_path, *options)
        return [(r["ar_token_ids"], r["spec_token_ids"]) for r in report["prompts"]]

    first = sampled(5)
    assert first == sampled(5)
    assert first != sampled(6)


def test_user_errors_are_one_line(runner, mtp_bundle, tmp_path):
    def error(*args) -> str:
        done = subprocess.run([str(runner), *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr
        lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1 and "Traceback" not in done.stderr
        return lines[0]

    assert "does not exist" in error("--bundle", str(tmp_path / "none"), "--prompt-ids", "1")
    assert "--k" in error("--bundle", mtp_bundle, "--prompt-ids", "1", "--k", "-1")
    assert "unknown option" in error("--bundle", mtp_bundle, "--prompt-ids", "1", "--speed")
    assert "draft-lm" in error("--bundle", mtp_bundle, "--prompt-ids", "1", "--drafter", "draft-lm")
    assert "--stop" in error("--bundle", mtp_bundle, "--prompt-ids", "1", "--stop", "")

    tampered = tmp_path / "tampered"
    shutil.copytree(mtp_bundle, tampered)
    with open(tampered / "target.pte", "r+b") as f:
        f.seek(-1, 2)
        byte = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([byte[0] ^ 1]))
    assert "sha256" in error("--bundle", str(tampered), "--prompt-ids", "1")


def _without(key):
    return lambda m: m.pop(key)


MANIFEST_CASES = [  # (what, edit of manifest.json, the key a refusal names; None: valid)
    ("as exported", lambda m: None, None),
    # the schema takes a null bos, but this bundle's hashed tokenizer has one: an edit
    ("an edited bos", lambda m: m.update(bos_id=None), "bos_id"),
    ("an empty drafter", lambda m: m.update(drafter={}), None),
    ("no chat_format", _without("chat_format"), None),
    ("no models", _without("models"), "models"),
    ("models a list", lambda m: m.update(models=[]), "models"),
    ("no target file", lambda m: m["models"].pop("target"), "models"),
    ("no drafter", _without("drafter"), "drafter"),
    ("max_seq_len text", lambda m: m.update(max_seq_len="lots"), "max_seq_len"),
    ("eos_ids with text", lambda m: m.update(eos_ids=[1, "2"]), "eos_ids"),
    ("vocab_size a float", lambda m: m.update(vocab_size=96.0), "vocab_size"),
    ("an unknown key", lambda m: m.update(extra=1), "extra"),
    ("k text", lambda m: m["drafter"].update(k="4"), "drafter.k"),
    ("an unknown kind", lambda m: m["drafter"].update(kind="magic"), "drafter.kind"),
    ("lookup a number", lambda m: m["drafter"].update(lookup=5), "drafter.lookup"),
    ("own_cache a number", lambda m: m["drafter"].update(own_cache=1), "drafter.own_cache"),
    ("an unknown drafter key", lambda m: m["drafter"].update(speed=9), "drafter.speed"),
    ("sha256 a number", lambda m: m["models"]["target"].update(sha256=1), "sha256"),
    ("no quant", lambda m: m["models"]["target"].pop("quant"), "quant"),
]


def test_python_and_native_readers_agree_on_manifests(runner, mlp_mtp_bundle, tmp_path):
    """Both readers of the bundle contract, fed the same manifests: the same accepted, the
    same refused, each refusal one line naming the same key."""
    from mtp_edge.errors import UserError
    from mtp_edge.runtime.bundle import open_bundle

    def names(message: str, key: str) -> bool:  # 'key' (the schema), or "says key is" (an edit)
        return f"'{key}" in message or f"says {key} is" in message

    exported = json.loads((Path(mlp_mtp_bundle) / "manifest.json").read_text())
    for i, (what, edit, key) in enumerate(MANIFEST_CASES):
        bundle = tmp_path / f"case{i}"
        shutil.copytree(mlp_mtp_bundle, bundle)
        manifest = json.loads(json.dumps(exported))
        edit(manifest)
        (bundle / "manifest.json").write_text(json.dumps(manifest))
        try:
            open_bundle(bundle)
            python_error = None
        except UserError as e:
            python_error = str(e)
        args = [str(runner), "--bundle", str(bundle), "--prompt-ids", "1,2,3"]
        done = subprocess.run(
            [*args, "--max-new-tokens", "2", "--drafter", "none"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if key is None:
            assert python_error is None, f"{what}: {python_error}"
            assert done.returncode == 0, f"{what}: {done.stderr[-500:]}"
            continue
        assert python_error is not None and names(python_error, key), f"{what}: {python_error}"
        assert done.returncode == 2, f"{what}: exit {done.returncode}: {done.stderr[-500:]}"
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and names(last, key), f"{what}: {last}"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def run_runner(runner, bundle, env=None) -> subprocess.CompletedProcess:
    """A short plain run of the runner on `bundle` (the model drafter not loaded)."""
    args = [str(runner), "--bundle", str(bundle), "--prompt-ids", "1,2,3"]
    args += ["--max-new-tokens", "2", "--drafter", "none"]
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)


def refusal(done: subprocess.CompletedProcess) -> str:
    """The one error line of a run refused as a user error."""
    assert done.returncode == 2, f"exit {done.returncode}: {done.stderr[-800:]}"
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_both_runtimes_fit_k_to_the_int8_tile_alike(runner, mlp_mtp_bundle, monkeypatch, capsys):
    """The bundle's k on a named CPU (MTP_EDGE_INT8_PATH), natively and in Python
    (runtime/assemble.py k_for_this_cpu): an 8da8w bundle of k = 4 drafts 3 where the CPU has no
    int8 dot product and a 4-row tile, saying so in the same line, 4 elsewhere; a name that is
    no path, one line alike."""
    from mtp_edge.errors import UserError
    from mtp_edge.runtime.assemble import assemble

    for path, expected in (("avx2", 3), ("sse4", 3), ("avx512", 4), ("avx512-vnni", 4),
                           ("neon-dot", 4), ("neon", 4)):  # fmt: skip
        env = {**os.environ, "MTP_EDGE_INT8_PATH": path}
        done = run_runner(runner, mlp_mtp_bundle, env)
        assert done.returncode == 0, done.stderr[-800:]
        assert json.loads(done.stdout)["k"] == expected, path
        capsys.readouterr()
        monkeypatch.setenv("MTP_EDGE_INT8_PATH", path)
        assert assemble(setup_options(mlp_mtp_bundle, 256)).config.k == expected, path
        said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[k]")]
        assert said == [line for line in done.stderr.splitlines() if line.startswith("[k]")]
        assert len(said) == (expected == 3), (path, said)
    monkeypatch.setenv("MTP_EDGE_INT8_PATH", "avx3")
    with pytest.raises(UserError) as python_error:
        assemble(setup_options(mlp_mtp_bundle, 256))
    native = refusal(run_runner(runner, mlp_mtp_bundle, {**os.environ}))
    assert native == f"error: {python_error.value}"


def test_both_runtimes_keep_k_within_our_int8_kernels_tile(
    runner, mlp_mtp_bundle, tmp_path, monkeypatch, capsys
):
    """A bundle whose target is 8da8w-avx2 (our int8 kernel: 6 rows a pass, on every CPU) keeps
    k <= 5 natively and in Python, whatever the CPU, in the same [k] line; k = 4 stands."""
    from mtp_edge.runtime.assemble import assemble

    def scheme_and_k(k):
        def edit(manifest):
            manifest["models"]["target"]["quant"]["scheme"] = "8da8w-avx2"
            manifest["drafter"]["k"] = k

        return edit

    for k, expected in ((7, 5), (4, 4)):
        bundle = edited_copy(mlp_mtp_bundle, tmp_path / f"k{k}", scheme_and_k(k))
        for path in ("avx2", "avx512-vnni", "neon-dot"):
            env = {**os.environ, "MTP_EDGE_INT8_PATH": path}
            done = run_runner(runner, bundle, env)
            assert done.returncode == 0, done.stderr[-800:]
            assert json.loads(done.stdout)["k"] == expected, (k, path)
            capsys.readouterr()
            monkeypatch.setenv("MTP_EDGE_INT8_PATH", path)
            assert assemble(setup_options(bundle, 256)).config.k == expected, (k, path)
            said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[k]")]
            assert said == [line for line in done.stderr.splitlines() if line.startswith("[k]")]
            assert len(said) == (k != expected), (k, path, said)
            assert all("8da8w-avx2 layers verify up to 6 tokens" in line for line in said)


def test_both_runtimes_fit_k_to_the_4_bit_tile_alike(
    runner, mlp_mtp_bundle, tmp_path, monkeypatch, capsys
):
    """A target whose 4-bit weights come in groups (8da4w, 8da4w-mix) verifies within XNNPACK's
    groupwise 4-bit tile: 3 rows on AVX2, so k = 4 drafts 2 there, natively and in Python, in
    the same [k] line; per channel the 8-bit tile's 4 rows (k = 3); with a dot product, and where
    the groupwise tile is not known, k stands. The same split in our kernels (8da4w-mix-avx2)
    verifies within their 6 rows on every CPU: k = 7 drafts 5."""
    from mtp_edge.runtime.assemble import assemble

    def scheme_and_group(scheme, group, given):
        def edit(manifest):
            manifest["models"]["target"]["quant"].update(scheme=scheme, group_size=group)
            manifest["drafter"]["k"] = given

        return edit

    cases = (
        ("8da4w-mix", 32, 4, {"avx2": 2, "sse4": 4, "avx512-vnni": 4}),
        ("8da4w", 32, 4, {"avx2": 2}),
        ("8da4w", 0, 4, {"avx2": 3, "avx512-vnni": 4}),
        ("8da4w-mix-avx2", 32, 7, {"avx2": 5, "avx512-vnni": 5}),
    )
    for scheme, group, given, expected in cases:
        bundle = edited_copy(
            mlp_mtp_bundle, tmp_path / f"{scheme}-{group}", scheme_and_group(scheme, group, given)
        )
        for path, k in expected.items():
            done = run_runner(runner, bundle, {**os.environ, "MTP_EDGE_INT8_PATH": path})
            assert done.returncode == 0, done.stderr[-800:]
            assert json.loads(done.stdout)["k"] == k, (scheme, group, path)
            capsys.readouterr()
            monkeypatch.setenv("MTP_EDGE_INT8_PATH", path)
            assert assemble(setup_options(bundle, 256)).config.k == k, (scheme, group, path)
            said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[k]")]
            assert said == [line for line in done.stderr.splitlines() if line.startswith("[k]")]
            assert len(said) == (k != given), (scheme, group, path, said)
            assert all(f"up to {k + 1} tokens" in line for line in said), said


def edited_copy(bundle, to: Path, edit) -> Path:
    shutil.copytree(bundle, to)
    manifest = json.loads((to / "manifest.json").read_text())
    edit(manifest)
    (to / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return to


def swap_two_tokens(tokenizer_json: Path) -> None:
    """Swap the ids of two vocabulary entries: the file still loads, but encodes and decodes
    those two tokens wrongly."""
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    a, b = [token for token, i in vocab.items() if 10 <= i < 100][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False))


def test_tampered_tokenizer_is_refused(runner, mlp_mtp_bundle, tmp_path):
    """tokenizer.json is hashed and checked like the programs: two vocabulary entries swapped
    is one error line naming it."""
    bundle = tmp_path / "bundle"
    shutil.copytree(mlp_mtp_bundle, bundle)
    swap_two_tokens(bundle / "tokenizer.json")
    line = refusal(run_runner(runner, bundle))
    assert line == (
        f"error: bundle {bundle}: tokenizer.json does not match its sha256 in manifest.json "
        "(modified or corrupted): re-export the bundle"
    )


@pytest.mark.parametrize("role, file", [("tokenizer", "tokenizer.json"),
                                        ("tokenizer_meta", "tokenizer_meta.json")])  # fmt: skip
def test_bundle_without_tokenizer_hashes_is_refused(runner, mlp_mtp_bundle, tmp_path, role, file):
    bundle = edited_copy(mlp_mtp_bundle, tmp_path / "old", lambda m: m["models"].pop(role))
    assert refusal(run_runner(runner, bundle)) == (
        f"error: bundle {bundle} has no sha256 for {file} in manifest.json (exported by an "
        "older mtp-export): re-export it"
    )


def test_file_names_that_leave_the_bundle_are_refused(runner, mlp_mtp_bundle, tmp_path):
    """models.*.file must name an entry of the bundle directory. Each name below points at a
    file whose sha256 the manifest gives (a copy of target.pte, or /etc/passwd), so a reader that
    opened it would pass the hash check: the refusal comes from the name alone."""
    target = Path(mlp_mtp_bundle) / "target.pte"
    (tmp_path / "x").mkdir()
    shutil.copy(target, tmp_path / "x" / "target.pte")
    cases = {
        "../x/target.pte": sha256_of(target),
        "/etc/passwd": sha256_of(Path("/etc/passwd")),
        "a/b": sha256_of(target),
        "..": sha256_of(target),
        ".": sha256_of(target),
        "": sha256_of(target),
        "a\\b": sha256_of(target),
    }
    for i, (name, digest) in enumerate(cases.items()):
        bundle = edited_copy(
            mlp_mtp_bundle,
            tmp_path / f"case{i}" / "bundle",
            lambda m, name=name, digest=digest: m["models"]["target"].update(
                file=name, sha256=digest
            ),
        )
        (bundle / "a").mkdir()
        shutil.copy(target, bundle / "a" / "b")
        line = refusal(run_runner(runner, bundle))
        assert line == (
            f"error: {bundle}/manifest.json: models.target.file '{name}' is not a plain file name "
            "inside the bundle: re-export the bundle"
        ), name

    # A symlink to a file outside the bundle: refused, though the file it reaches is intact.
    bundle = tmp_path / "linked"
    shutil.copytree(mlp_mtp_bundle, bundle)
    (bundle / "target.pte").unlink()
    (bundle / "target.pte").symlink_to(tmp_path / "x" / "target.pte")
    assert refusal(run_runner(runner, bundle)) == (
        f"error: {bundle}/manifest.json: models.target.file 'target.pte' links outside the "
        "bundle: re-export the bundle"
    )
    # ... and one to a file inside it is followed.
    (bundle / "target.pte").unlink()
    shutil.copy(target, bundle / "program.pte")
    (bundle / "target.pte").symlink_to("program.pte")
    done = run_runner(runner, bundle)
    assert done.returncode == 0, done.stderr[-800:]


def test_verified_once_stamp(runner, mlp_mtp_bundle, tmp_path):
    """After a full check the runtime records each file's size, mtime and sha256 in the user's
    cache and does not hash a file again while they match: a file changed behind the runtime's
    back with its size and mtime restored goes unnoticed (which shows the stamp is used), is
    refused with MTP_EDGE_VERIFY=always, once its mtime differs, or once the stamp's sha256 is
    not the manifest's."""
    bundle = tmp_path / "bundle"
    shutil.copytree(mlp_mtp_bundle, bundle)
    cache = tmp_path / "cache"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    env.pop("MTP_EDGE_VERIFY", None)
    assert run_runner(runner, bundle, env).returncode == 0

    real = os.path.realpath(bundle)
    stamp = (
        cache / "mtp-edge" / "verified" / f"{hashlib.sha256(real.encode()).hexdigest()[:32]}.json"
    )
    written = json.loads(stamp.read_text())
    models = json.loads((bundle / "manifest.json").read_text())["models"]
    assert written["bundle"] == real
    assert set(written["files"]) == {entry["file"] for entry in models.values()}
    for entry in models.values():
        st = (bundle / entry["file"]).stat()
        assert written["files"][entry["file"]] == {
            "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": entry["sha256"]
        }  # fmt: skip
    assert [p.name for p in stamp.parent.iterdir()] == [stamp.name]  # no temporary left

    # One bit of target.pte changed, size and mtime as they were.
    program = bundle / "target.pte"
    st = program.stat()
    flip_bit_keeping_mtime(program)
    assert program.stat().st_mtime_ns == st.st_mtime_ns
    done = run_runner(runner, bundle, env)
    assert done.returncode == 0, f"the stamp was not used: {done.stderr[-800:]}"

    mismatch = (
        f"error: bundle {bundle}: target.pte does not match its sha256 in manifest.json "
        "(modified or corrupted): re-export the bundle"
    )
    assert refusal(run_runner(runner, bundle, {**env, "MTP_EDGE_VERIFY": "always"})) == mismatch
    os.utime(program, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert refusal(run_runner(runner, bundle, env)) == mismatch
    os.utime(program, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert run_runner(runner, bundle, env).returncode == 0  # a refusal writes no stamp
    written["files"]["target.pte"]["sha256"] = "0" * 64
    stamp.write_text(json.dumps(written))
    assert refusal(run_runner(runner, bundle, env)) == mismatch

    # No cache to write to (no HOME, as on a phone; or a cache path that is a file): checked,
    # run, nothing written.
    clean = tmp_path / "clean"
    shutil.copytree(mlp_mtp_bundle, clean)
    bare = {k: v for k, v in env.items() if k not in ("HOME", "XDG_CACHE_HOME")}
    assert run_runner(runner, clean, bare).returncode == 0
    (tmp_path / "file").write_text("")
    blocked = {**env, "XDG_CACHE_HOME": str(tmp_path / "file")}
    assert run_runner(runner, clean, blocked).returncode == 0


def flip_bit_keeping_mtime(program: Path) -> None:
    """The lowest bit of the program's last float (a quantization scale) flipped, its size and
    mtime as they were: the program still runs, and only hashing notices."""
    st = program.stat()
    data = bytearray(program.read_bytes())
    data[-4] ^= 1
    program.write_bytes(bytes(data))
    os.utime(program, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_python_and_native_readers_share_the_stamp(runner, mlp_mtp_bundle, tmp_path, monkeypatch):
    """Each reader trusts the stamp the other wrote: a change behind their back with size and
    mtime restored goes unnoticed by the second reader."""
    from mtp_edge.errors import UserError
    from mtp_edge.manifest import Manifest

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    by_python = tmp_path / "by_python"
    shutil.copytree(mlp_mtp_bundle, by_python)
    Manifest.load(by_python)
    flip_bit_keeping_mtime(by_python / "target.pte")
    done = run_runner(runner, by_python)
    assert done.returncode == 0, f"Python's stamp was not used: {done.stderr[-800:]}"

    by_native = tmp_path / "by_native"
    shutil.copytree(mlp_mtp_bundle, by_native)
    assert run_runner(runner, by_native).returncode == 0
    flip_bit_keeping_mtime(by_native / "target.pte")
    Manifest.load(by_native)  # the native runner's stamp trusted
    monkeypatch.setenv("MTP_EDGE_VERIFY", "always")
    with pytest.raises(UserError, match="target.pte does not match its sha256"):
        Manifest.load(by_native)


def mtp_runner_command(*args) -> list[str]:
    return [sys.executable, "-c", "from mtp_edge.runtime.native_runner import main; main()", *args]


def test_mtp_runner_checks_arguments_before_building(runner, tmp_path):
    """mtp-runner answers --help and a missing or wrong --bundle without running cmake (here a
    cmake that only records being called), with the runner's own usage and one-line errors."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    called = tmp_path / "cmake-called"
    (bin_dir / "cmake").write_text(f"#!/bin/sh\ntouch {called}\nexit 1\n")
    (bin_dir / "cmake").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    def mtp_runner(*args) -> subprocess.CompletedProcess:
        return subprocess.run(mtp_runner_command(*args), capture_output=True, text=True, env=env)

    help_text = subprocess.run([str(runner), "--help"], capture_output=True, text=True).stdout
    for flag in ("--help", "-h"):
        done = mtp_runner(flag)
        assert done.returncode == 0 and done.stdout == help_text, done.stderr
    done = mtp_runner("--bundle", str(tmp_path), "--prompt-ids", "1", "--help")
    assert done.returncode == 0 and done.stdout == help_text
    no_bundle = tmp_path / "none"
    not_a_bundle = tmp_path / "empty"
    not_a_bundle.mkdir()
    for args in [
        ("--bundle", str(no_bundle), "--prompt-ids", "1"),
        ("--bundle", str(not_a_bundle), "--prompt-ids", "1"),
        ("--prompt-ids", "1"),
        ("--prompt-ids", "1", "--bundle"),
    ]:
        done = mtp_runner(*args)
        native_done = subprocess.run([str(runner), *args], capture_output=True, text=True)
        assert refusal(done) == refusal(native_done), args
        assert done.stderr.count("\n") == 1, done.stderr
    assert refusal(mtp_runner("--bundle", str(no_bundle))) == (
        f"error: bundle {no_bundle} does not exist: export one with mtp-export"
    )
    assert not called.exists()
    # A value that looks like an option is a value, as the runner reads it.
    done = mtp_runner("--bundle", str(no_bundle), "--prompt", "-h")
    assert "does not exist" in refusal(done)
    assert not called.exists()


def test_options_taking_values_match_the_runner_source():
    """mtp-runner reads the options that take a value from the usage text of mtp_runner.cpp;
    they are the options whose branch in run() reads a value."""
    source = native_runner.RUNNER_SOURCE.read_text()
    branches = re.findall(r'flag == "(--[\w-]+)"[^{]*\{(.*?)\n    \}', source, re.S)
    assert len(branches) > 20
    reads_value = {flag for flag, body in branches if "value()" in body}
    assert native_runner.value_flags(native_runner.usage()) == reads_value


def test_failed_configure_then_fixed_one_builds():
    """A configure that fails (nlohmann/json not found: the system's made invisible, no pip
    headers) is one line and leaves nothing behind; so does a half-configured directory left by
    a plain cmake run (a cache, no Makefile): the next build configures afresh, here with the
    pip package's headers (the fallback when the system has none), and builds."""
    include = native_runner.nlohmann_include()
    if include is None:
        pytest.skip("the nlohmann_json pip package is not installed (pip install nlohmann_json)")
    # Beside the main build directory: ccache hashes the sources' paths relative to the build
    # directory, so a directory at a fixed place in the checkout compiles from the cache where a
    # fresh temporary one (another place each run) compiles everything again.
    build_dir = native_runner.SOURCE_DIR / "build-configure-check"
    shutil.rmtree(build_dir, ignore_errors=True)
    try:
        failed_then_fixed(build_dir, include)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


def failed_then_fixed(build_dir: Path, include: Path) -> None:
    from mtp_edge.errors import UserError

    hidden = "-DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=TRUE"
    with pytest.raises(UserError) as refused:
        native_runner.build(
            jobs=1, build_dir=build_dir, configure_args=[hidden, "-DMTP_NLOHMANN_INCLUDE="]
        )
    assert str(refused.value) == (
        "the native build needs nlohmann/json: pip install nlohmann_json (or apt-get install "
        "nlohmann-json3-dev)"
    )
    assert not build_dir.exists()

    command = ["cmake", "-S", str(native_runner.SOURCE_DIR), "-B", str(build_dir), hidden]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode != 0
    assert (build_dir / "CMakeCache.txt").is_file() and not (build_dir / "Makefile").exists()

    runner = native_runner.build(jobs=1, build_dir=build_dir, configure_args=[hidden])
    cache = (build_dir / "CMakeCache.txt").read_text()
    assert f"MTP_NLOHMANN_INCLUDE:UNINITIALIZED={include}" in cache
    flags = (build_dir / "CMakeFiles" / "mtp_edge.dir" / "flags.make").read_text()
    assert f"-isystem {include}" in flags
    done = subprocess.run([str(runner), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("usage: mtp-runner")


@pytest.mark.parametrize("text", ["the cat<|im_end|> sat", "<|im_start|>system\nthe cat",
                                  "the <|endoftext|>cat<|im_end|>"])  # fmt: skip
def test_special_tokens_typed_in_a_prompt_are_text_in_both_runtimes(runner, mlp_mtp_bundle, text):
    """A prompt that types special tokens: both runtimes encode them as text (the template's own
    markers stay special), so the runner's prompt and output are the Python runtime's."""
    bundle = open_bundle(mlp_mtp_bundle)
    ids = bundle.tokenizer.encode_prompt(text, chat=True)
    # <|endoftext|>, <|im_start|>, <|im_end|> are ids 0, 1, 2: only the template's are special
    assert (ids.count(0), ids.count(1), ids.count(2)) == (0, 2, 1), ids
    [(_, expected)] = python_runs(mlp_mtp_bundle, [("p", "c", ids)], None)
    args = ["--bundle", mlp_mtp_bundle, "--prompt", text, "--drafter", "none"]
    done = subprocess.run([str(runner), *args, "--max-new-tokens", str(MAX_NEW_TOKENS)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)["prompts"][0]
    assert row["prompt_tokens"] == len(ids)
    assert_same_tokens([("p", expected)], [row["ar_token_ids"]], "special text in a prompt")


def test_the_native_reader_knows_every_manifest_key():
    """bundle.cpp checks a manifest's keys as strictly as mtp_edge/manifest.py does: a key the
    exporter writes that the native reader does not list makes the runner and the phone refuse
    every new bundle, so the two lists must be the same."""
    from dataclasses import fields

    from mtp_edge.manifest import DrafterSpec, Manifest, ModelFile

    source = (Path(__file__).parents[1] / "runtime/native/src/bundle.cpp").read_text()

    def native(table: str) -> set[str]:
        block = re.search(rf"const std::vector<Key> {table} = \{{(.*?)\n\}};", source, re.S)
        assert block is not None, table
        return set(re.findall(r'\{"(\w+)",', block.group(1)))

    assert native("kManifestKeys") == {f.name for f in fields(Manifest)}
    assert native("kModelFileKeys") == {f.name for f in fields(ModelFile)}
    assert native("kDrafterKeys") == {f.name for f in fields(DrafterSpec)}


FALLBACK_COSTS = (10.0, 0.1, 1.0)  # mtp-runner --fallback-costs: verify ms, slope, draft ms


def modelled_fallback():
    """runtime/fallback.py's Fallback told mtp-runner's --fallback-costs instead of timings
    (fallback.h CostModel, the same arithmetic): both loops then decide from the same costs."""
    from mtp_edge.runtime.fallback import Fallback

    verify_ms, slope, draft_ms = FALLBACK_COSTS

    class Modelled(Fallback):
        def record_step(self, requested, drafted, accepted, draft_seconds, verify_seconds):
            lookup = self.source in ("ngram", "lookup")
            draft = 0.0 if lookup else requested * draft_ms / 1e3
            verify = verify_ms * (1 + slope * (drafted + 1 - 1)) / 1e3
            super().record_step(requested, drafted, accepted, draft, verify)

    return Modelled


def python_steps(bundle_dir, prompts, drafter, fallback, monkeypatch) -> list:
    """Per prompt (tokens, [(drafted, accepted) per verify step], drafts as DraftRecorder
    records them, the steps the fallback drafted nothing for): runtime/loop.py's decode with the
    drafter runtime/assemble.py builds for `drafter` (None: the bundle's default), on one
    session, as mtp-runner runs the prompts."""
    from mtp_edge.runtime.assemble import LoadOptions, assemble
    from mtp_edge.runtime.loop import decode

    monkeypatch.setattr("mtp_edge.runtime.loop.Fallback", modelled_fallback())
    options = LoadOptions(bundle=bundle_dir, drafter=drafter, fallback=fallback, chat=False)
    gen = assemble(options, max_new_tokens=MAX_NEW_TOKENS)
    drafts: list = []
    recorder = None if gen.drafter is None else DraftRecorder(gen.drafter, drafts)
    runs = []
    for _, _, ids in prompts:
        drafts.append([])
        tokens, steps, before = [], [], (0, 0, 0)
        for step in decode(gen.session, ids, recorder, gen.config):
            s = step.stats
            now = (s.verify_steps, s.drafted_tokens, s.accepted_tokens)
            if now[0] > before[0]:
                steps.append((now[1] - before[1], now[2] - before[2]))
            tokens += step.tokens
            before = now
        runs.append((tokens, steps, drafts[-1], step.stats.fallback_steps))
    return runs


@pytest.mark.parametrize(
    "bundle_name, drafter, fallback",
    [("mtp_bundle", "none", False)]
    + [
        (bundle_name, drafter, fallback)
        for bundle_name, drafter in [
            ("mtp_bundle", "ngram"),
            ("mtp_bundle", "mtp"),
            ("mtp_bundle", "mtp+ngram"),
            ("self_mtp_bundle", "mtp+ngram"),
            ("draft_lm_bundle", "draft-lm"),
            ("draft_lm_bundle", "draft-lm+ngram"),
        ]
        for fallback in (False, True)
    ],
)
def test_loops_draft_and_accept_alike_step_by_step(
    request, runner, tmp_path, monkeypatch, bundle_name, drafter, fallback
):
    """The C++ loop and runtime/loop.py, on the same bundle and prompts with the same drafter:
    at every verify step the same number of tokens drafted and accepted, with the fallback too
    (both told the same fixed costs, so that its choices do not follow timings: with the
    random heads' drafts rarely right, it stops drafting the model and drafts the free lookup,
    shadowing as runtime/fallback.py does). Where the runtimes' kernels round a draft's two
    best logits apart (see the module doc) the rest of that prompt is not compared."""
    bundle = request.getfixturevalue(bundle_name)
    prompts = suite_ids(bundle)[::4]
    options = ["--drafter", drafter, "--record-drafts"]
    if fallback:
        options += ["--fallback", "--fallback-costs", ",".join(map(str, FALLBACK_COSTS))]
    report = run_native(runner, bundle, prompts, tmp_path, *options)
    assert report["drafter"] == drafter and report["summary"]["lossless"]
    python = python_steps(bundle, prompts, drafter, fallback, monkeypatch)
    compared = 0
    for r, (tokens, steps, drafts, _) in zip(report["prompts"], python, strict=True):
        what = f"{bundle_name} {drafter}, prompt {r['id']}"
        if drafter != "none" and not same_drafts(drafts, r.get("spec_drafts", []), what):
            continue
        compared += 1
        assert r["spec_token_ids"] == tokens, what
        assert [tuple(x) for x in r["spec_steps"]] == steps, what
        assert r["verify_steps"] == len(steps), what
    assert compared >= len(prompts) * 3 // 4, f"only {compared} of {len(prompts)} compared"
    fell_back = sum(run[3] for run in python)
    assert fell_back > 0 if fallback else fell_back == 0  # the fallback decided something


def test_token_ids_outside_the_vocabulary_are_refused(runner, mtp_bundle, tmp_path):
    """Token ids are range-checked before any kernel sees them (the embedding kernel would
    abort the process), from --prompt-ids, a prompts file, and the engine for the C API;
    with the other argument checks before anything loads."""
    vocab = open_bundle(mtp_bundle).manifest.vocab_size

    def refused(*args) -> str:
        done = subprocess.run([str(runner), "--bundle", mtp_bundle, *args], capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert done.returncode == 2, (args, done.returncode, done.stderr[-500:])
        [line] = done.stderr.splitlines()
        assert line.startswith("error: ") and "[load]" not in done.stderr, line
        return line

    for ids in ("1,99999999,3", "1,-5,3", f"1,{vocab}"):
        assert f"ids must be in 0..{vocab - 1}" in refused("--prompt-ids", ids)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_ids": [1, vocab + 7]}) + "\n")
    assert "prompt a: token id" in refused("--prompts", str(prompts))
    assert "must be in 0..18446744073709551615" in refused("--prompt-ids", "1", "-s", "-1")
    assert "cannot write" in refused("--prompt-ids", "1", "--json", "/proc/x/o.json")
    assert "is a directory" in refused("--prompt-ids", "1", "--json", str(tmp_path))
    for flag, value in [("--temperature", "nan"), ("--temperature", "-1"), ("--top-p", "0"),
                        ("--top-p", "1.5"), ("--k", "16"), ("--k", "0"), ("--top-k", "-1"),
                        ("--max-new-tokens", "0"), ("--draft-confidence", "1"),
                        ("--threads", "-1"), ("--ngram-sizes", "3-1"),
                        ("--fallback-costs", "10,0.1")]:  # fmt: skip
        assert flag in refused("--prompt-ids", "1", flag, value)
    assert "unknown drafter 'bundle'" in refused("--prompt-ids", "1", "--drafter", "bundle")
    assert not (tmp_path / "o.json").exists()
    # The last id of the vocabulary is fine.
    done = subprocess.run([str(runner), "--bundle", mtp_bundle, "--prompt-ids", f"1,{vocab - 1}",
                           "-n", "2", "--json", str(tmp_path / "o.json")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-1000:]


DRAFTER_NAMES = ["none", "ngram", "mtp", "draft-lm", "mtp+ngram", "draft-lm+ngram", "ngram+ngram",
                 "none+ngram", "bundle", "bundle+ngram", "warp", "./draft"]  # fmt: skip


def test_both_runtimes_take_the_same_drafter_names(runner, mtp_bundle):
    """The native engine takes exactly the drafter names mtp-run takes for a bundle
    (runtime/assemble.py build_drafter): each name either both build or both refuse. The
    runner checks the name before the prompt's ids, so an accepted name shows as the refusal
    of an id outside the vocabulary, before anything loads."""
    from mtp_edge.errors import UserError
    from mtp_edge.runtime.assemble import build_drafter

    bundle = open_bundle(mtp_bundle)
    for name in DRAFTER_NAMES:
        try:
            build_drafter(name, None, bundle, bundle.manifest.max_seq_len)
            python_takes = True
        except UserError:
            python_takes = False
        done = subprocess.run(
            [str(runner), "--bundle", mtp_bundle, "--prompt-ids", "99999999", "--drafter", name],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 2, done.stderr
        native_takes = "token id 99999999" in done.stderr
        assert native_takes == python_takes, (name, done.stderr)


def test_runner_ranges_are_the_python_commands(runner, mtp_bundle):
    """mtp-runner's flags take exactly the ranges of mtp_edge/limits.py (mtp-run's, the API's,
    the server's): a bound is accepted (seen as the refusal of an id outside the vocabulary,
    which the runner checks after the flags), one step past it refused naming the flag, both
    before anything loads."""
    from mtp_edge.limits import LIMITS

    flags = {"k": "--k", "max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
             "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed", "threads": "--threads",
             "draft_confidence": "--draft-confidence"}  # fmt: skip

    def stderr(flag, value) -> str:
        done = subprocess.run(
            [str(runner), "--bundle", mtp_bundle, "--prompt-ids", "99999999", flag, str(value)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 2 and "[load]" not in done.stderr, (flag, value, done.stderr)
        return done.stderr

    for setting, flag in flags.items():
        limit = LIMITS[setting]
        step = 1 if limit.kind is int else 1e-9
        for bound, is_low, is_open in [(limit.low, True, limit.low_open),
                                       (limit.high, False, limit.high_open)]:  # fmt: skip
            if bound is None:
                continue
            outside = bound if is_open else (bound - step if is_low else bound + step)
            assert flag in stderr(flag, outside), (flag, outside)
            if not is_open:
                assert "token id 99999999" in stderr(flag, bound), (flag, bound)


def store_stream(seed: int, requests: int, vocab: int = 12) -> list[tuple[list[int], int]]:
    """Requests (tokens, prompt length) that resemble each other, as a deployment's do: each a
    few phrases of a shared set over a small vocabulary, one token in three phrases changed, so
    that contexts recur followed by the same token and by others (confident, unconfident and
    tied continuations); one in four a chat's next turn (the last request, its last token
    changed now and then, and more)."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(vocab) for _ in range(rng.randrange(3, 9))] for _ in range(24)]
    stream: list[tuple[list[int], int]] = []
    for _ in range(requests):
        tokens: list[int] = []
        for _ in range(rng.randrange(1, 6)):
            phrase = list(rng.choice(phrases))
            if rng.random() < 0.3:
                phrase[rng.randrange(len(phrase))] = rng.randrange(vocab)
            tokens += phrase
        prompt = rng.randrange(1, len(tokens) + 1)
        if stream and rng.random() < 0.25:
            last = list(stream[-1][0])
            if rng.random() < 0.3:
                last[-1] = rng.randrange(vocab)
            prompt, tokens = len(last) + prompt, last + tokens
        stream.append((tokens, prompt))
    return stream


@pytest.mark.parametrize("max_tokens", [400, 32768])
def test_native_store_drafts_what_the_python_store_drafts(runner, tmp_path, max_tokens):
    """The C++ AnswerStore (src/answer_store.cpp, driven by `mtp-native-tests store FILE`)
    drafts exactly what runtime/answer_store.py drafts: from every prefix of each of 300
    requests before it enters the store, with k from 1 to 6, ties and evictions included (a
    bound of 400 tokens keeps the last dozen requests)."""
    from mtp_edge.runtime.answer_store import AnswerStore

    store = AnswerStore(max_tokens=max_tokens)
    lines, expected = [json.dumps({"max_tokens": max_tokens})], []
    for tokens, prompt in store_stream(0, 300):
        for end in range(1, len(tokens) + 1):
            k = 1 + end % 6
            lines.append(json.dumps({"draft": tokens[:end], "k": k}))
            expected.append(store.draft(tokens[:end], k))
        lines.append(json.dumps({"add": tokens, "prompt": prompt}))
        store.add(tokens, prompt)
    path = tmp_path / "store.jsonl"
    path.write_text("\n".join(lines) + "\n")
    done = subprocess.run(
        [str(native_runner.UNIT_TESTS), "store", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    *drafts, report = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(drafts) == len(expected)
    for i, (ours, theirs) in enumerate(zip(drafts, expected, strict=True)):
        assert ours == theirs, f"draft {i}: native {ours}, Python {theirs}"
    assert report == store.report()
    assert store.drafts > len(expected) // 10  # the store drafted often, and not always
    assert sum(map(bool, expected)) < len(expected)
    tied = [
        nexts
        for table in store.tables.values()
        for nexts in table.values()
        if list(nexts.values()).count(max(nexts.values())) > 1 and max(nexts.values()) >= 2
    ]
    assert tied  # confident ties were there to break
    if max_tokens == 400:
        assert len(store.sequences) < 300 and store.tokens <= 400
    assert any(first > 0 for _, first in store.sequences)  # continued conversations were there


def test_c_api_store_is_lossless_and_learns(runner, mtp_bundle):
    """mtp_generate with "store": true (tests/test_core.cpp run_store_api checks each result):
    greedy tokens equal plain decoding's with the store and without, the engine's store takes
    in each request, and the third run of a prompt has the head's drafts extended from the
    first two, which makes it take fewer verify steps; sampling and a chat with the store run."""
    text = "the cat sat on the mat. the cat sat on the"
    done = subprocess.run(
        [str(native_runner.UNIT_TESTS), "store-api", mtp_bundle, text],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    plain, first, second, third, sampled, chat = map(json.loads, done.stdout.splitlines())
    assert plain["stats"]["drafted_tokens"] == 0
    assert first["token_ids"] == second["token_ids"] == third["token_ids"] == plain["token_ids"]
    assert first["store_extended"] == 0 < third["store_extended"]
    assert third["stats"]["accepted_tokens"] > first["stats"]["accepted_tokens"]
    assert third["stats"]["verify_steps"] < first["stats"]["verify_steps"]
    assert sampled["store_requests"] == 4 and sampled["stats"]["generated_tokens"] > 0
    assert chat["store_requests"] == 5


@pytest.mark.parametrize("drafter", ["mtp", "mtp+ngram"])
def test_runner_store_drafts_as_python_adapt(
    runner, mtp_bundle_of, mlp_mtp_bundle, tmp_path, drafter
):
    """mtp-runner --store against runtime/adapt.py's AdaptingDrafter (the MTP head, the store
    going on where the head stops short of k; its correction never trained, so it drafts as the
    head) on runtime/loop.py, the store fed each prompt's ids and answer as mtp-runner feeds
    it: three rounds of the same four prompts, the same tokens, verify steps and accepted
    tokens per prompt, the same store; greedy output equal to plain decoding, and the last
    round taking fewer verify steps than the first. With mtp+ngram the store extends the head's
    drafts only, not the lookup's (adapting() wraps a hybrid's model)."""
    from mtp_edge.runtime.adapt import adapting, bundle_heads

    tails = suite_ids(mlp_mtp_bundle)[:4]
    prompts = [(f"{i}-{r}", c, ids) for r in range(3) for i, c, ids in tails]
    options = ["--drafter", drafter, "--draft-confidence", "0.3", "--store"]
    report = run_native(runner, mlp_mtp_bundle, prompts, tmp_path, *options)
    rows = report["prompts"]
    assert report["summary"]["lossless"] and all(r["identical"] for r in rows)

    bundle = open_bundle(mlp_mtp_bundle)
    session = target_session(bundle)
    heads = mtp_bundle_of("none").parent / "heads.safetensors"
    head = bundle_drafter(bundle, 0.3)
    if drafter == "mtp+ngram":  # the runner's default lookup sizes, 1-3
        head = HybridDrafter(head, max_n=3, min_match=1)
    python, adapter = adapting(head, *bundle_heads(bundle, str(heads)))
    config = GenerationConfig(
        max_new_tokens=MAX_NEW_TOKENS, k=4, eos_ids=tuple(bundle.manifest.eos_ids)
    )
    for r, (prompt_id, _, ids) in zip(rows, prompts, strict=True):
        result = generate(session, ids, python, config, bundle.tokenizer.decode)
        assert r["spec_token_ids"] == result.token_ids, prompt_id
        assert r["verify_steps"] == result.stats.verify_steps, prompt_id
        assert r["acceptance_rate"] == pytest.approx(result.stats.acceptance_rate, abs=1e-4)
        adapter.store.add(ids + result.token_ids, len(ids))
    assert not adapter.active  # the head drafted uncorrected, as the native one
    assert report["drafter"] == drafter
    if drafter == "mtp+ngram":
        assert python.from_lookup > 0  # the lookup drafted too, unextended
    store = adapter.store.report()
    assert {key: report[key] for key in store} == store
    assert store["store_drafts"] > 0 and sum(r["store_extended"] for r in rows) > 0
    first, last = rows[:4], rows[8:]
    assert sum(r["verify_steps"] for r in last) < sum(r["verify_steps"] for r in first)


def test_c_api_request_log_is_what_python_reads(mtp_bundle, tmp_path):
    """mtp_request_log (`mtp-native-tests request-log`): nothing written before it is called;
    then each answered request, one user message (raw without the chat format) or a chat's
    conversation with its system prompt, as mtp_edge/request_log.py reads it, bounded and
    rotated by file_bytes and keep; Python appends to the same folder; a second engine's store
    is seeded from it; bad options and an unwritable folder refused in one line."""
    from types import SimpleNamespace

    from mtp_edge.api import Model
    from mtp_edge.request_log import RequestLog, read_log

    log = tmp_path / "log"
    done = subprocess.run(
        [str(native_runner.UNIT_TESTS), "request-log", mtp_bundle, str(log)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    by = {}
    for row in rows:
        by.setdefault(row["what"], []).append(row["result"])
    assert by["bad keep"] == ["keep must be a whole number"]
    assert by["bad option"] == ["unknown request log option 'files' (file_bytes, keep, seed_store)"]
    assert by["not a folder"][0].startswith(f"cannot write the request log in {log}.file: ")
    assert by["opened"][0]["log"] == str(log) and by["opened"][0]["seeded_requests"] == 0
    assert by["stopped"] == [{"log": None}]

    # What each logged generation should have written, in order.
    tokenizer = open_bundle(mtp_bundle).tokenizer
    system = {"role": "system", "content": "You answer briefly."}
    first, second = by["turn"]
    expected = [
        ([{"role": "user", "content": "the cat sat on the mat"}], by["chat"][0]),
        ([{"role": "user", "content": "hi, hi, hi, hi", "raw": True}], by["raw"][0]),
        ([system, {"role": "user", "content": "the cat sat on the mat"}], first),
        (
            [
                system,
                {"role": "user", "content": "the cat sat on the mat"},
                {"role": "assistant", "content": tokenizer.decode(first["token_ids"])},
                {"role": "user", "content": "and then? é 🤗"},
            ],
            second,
        ),
    ] + [([{"role": "user", "content": "one two three four five"}], r) for r in by["more"]]
    records = list(read_log(log))
    # Rotated at 1 KiB with one older file kept: the newest requests, never a torn line.
    files = sorted(p.name for p in log.glob("requests*.jsonl"))
    assert files == ["requests.1.jsonl", "requests.jsonl"]
    assert all((log / f).stat().st_size <= 1024 for f in files)
    assert 2 <= len(records) < len(expected)
    for record, (messages, result) in zip(records, expected[-len(records) :], strict=True):
        assert record.messages == messages
        assert record.answer_ids == result["token_ids"]
        assert record.tau == pytest.approx(result["stats"]["tau"], abs=1e-4)
    raw_rows = [json.loads(x) for f in files[::-1] for x in (log / f).read_text().splitlines()]
    assert {r["model"] for r in raw_rows} == {open_bundle(mtp_bundle).manifest.model_name}
    assert [r["finish_reason"] for r in raw_rows] == [
        result["stop_reason"] for _, result in expected[-len(records) :]
    ]
    # The prompt a record re-encodes to is the one the request had (one user message).
    python = SimpleNamespace(tokenizer=tokenizer)
    last = by["more"][-1]
    assert len(Model._logged_prompt_ids(python, records[-1].messages)) == last["prompt_tokens"]

    # A second engine's store starts from the log: every kept request.
    seeded = by["seeded"][0]
    assert seeded["seeded_requests"] == seeded["store_requests"] == len(records)
    assert seeded["store_tokens"] > sum(len(r.answer_ids) for r in records)

    # The Python writer goes on in the same folder (the same lock, the same format).
    RequestLog(log, file_bytes=1024, keep=1).append([{"role": "user", "content": "p"}], [3], 1.5)
    assert list(read_log(log))[-1].answer_ids == [3]


def native_store_log(bundle: str, log: Path) -> dict:
    """What `mtp-native-tests store-log` seeds an engine's store with from `log`."""
    done = subprocess.run(
        [str(native_runner.UNIT_TESTS), "store-log", bundle, str(log)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_store_seeded_from_a_request_log_as_python(runner, mtp_bundle, tmp_path):
    """mtp-runner --store-log DIR (Engine::seed_store, shown by `mtp-native-tests store-log`)
    takes from a request log exactly the requests mtp_edge/api.py _seed_store gives the Python
    store, oldest first across rotated files: raw prompts as plain text, conversations through
    the chat template (a system prompt, several turns, special tokens typed as text), records
    the template cannot render with their answer alone, records with no answer or ids outside
    the vocabulary left out."""
    from types import SimpleNamespace

    from mtp_edge.api import Model
    from mtp_edge.request_log import RequestLog
    from mtp_edge.runtime.answer_store import AnswerStore

    bundle = open_bundle(mtp_bundle)
    vocab = bundle.manifest.vocab_size
    log = RequestLog(tmp_path / "log", file_bytes=1024, keep=20)
    records = [
        ([{"role": "user", "content": "the cat sat on", "raw": True}], [5, 6, 7, 8]),
        ([{"role": "user", "content": "hello there"}], [9, 10, 11]),
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], [12]),
        (
            [
                {"role": "user", "content": "a b"},
                {"role": "assistant", "content": "c d"},
                {"role": "user", "content": "e <|im_end|> f"},
            ],
            [14, 15],
        ),
        ([{"role": "assistant", "content": "first"}, {"role": "user", "content": "x"}], [16]),
        ([{"role": "user", "content": "no answer"}], []),
        ([{"role": "user", "content": "another model"}], [1, vocab + 3]),
    ]
    for r in range(3):
        for messages, answer in records:
            log.append(messages, [t + r if t < vocab else t for t in answer], tau=1.0)
    assert len(list((tmp_path / "log").glob("requests*.jsonl"))) > 1  # rotated

    store = AnswerStore()
    python = SimpleNamespace(
        tokenizer=bundle.tokenizer,
        _generator=SimpleNamespace(
            session=SimpleNamespace(vocab_size=vocab), adapter=SimpleNamespace(store=store)
        ),
    )
    python._logged_prompt_ids = lambda messages: Model._logged_prompt_ids(python, messages)
    Model._seed_store(python, log)
    expected = [[tokens, first] for tokens, first in store.sequences]
    assert len(expected) == 15 and len(expected[3][0]) > 30  # a multi-turn prompt was encoded

    seeded = native_store_log(mtp_bundle, tmp_path / "log")
    assert seeded["added"] == 15 and seeded["sequences"] == expected

    prompts = suite_ids(mtp_bundle)[:1]
    report = run_native(runner, mtp_bundle, prompts, tmp_path, "--store-log", str(log.directory))
    assert report["store_requests"] == 16

    # A record torn by a killed writer, then more appended: the torn line alone is skipped,
    # by both readers alike.
    newest = log.directory / "requests.jsonl"
    newest.write_text('{"messages": [{"role": "user", "con')
    log.append([{"role": "user", "content": "after the tear"}], [21, 22], tau=1.0)
    store = python._generator.adapter.store = AnswerStore()
    Model._seed_store(python, log)
    expected = [[tokens, first] for tokens, first in store.sequences]
    seeded = native_store_log(mtp_bundle, tmp_path / "log")
    assert seeded["sequences"] == expected and expected[-1][0][-2:] == [21, 22]

    # A line that is JSON but no record is the log's fault, named by file:line.
    newest.write_text('{"messages": \n[1, 2]\n')
    done = subprocess.run(
        [
            str(runner),
            "--bundle",
            mtp_bundle,
            "--prompt-ids",
            "1",
            "--store-log",
            str(log.directory),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert (
        done.stderr.splitlines()[-1]
        == f"error: {log.directory / 'requests.jsonl'}:2: expected a JSON object"
    )
