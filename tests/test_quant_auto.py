"""mtp-export --quant auto: the rule that picks among measured candidates (made-up tables), the
options it takes and refuses, and one search on a tiny model with two candidate schemes."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

import pytest
from click.testing import CliRunner

from mtp_edge.cli import export as mtp_export
from mtp_edge.errors import UserError
from mtp_edge.exporter import choose
from mtp_edge.exporter.choose import QUALITY_BOUND, SearchPlan, pick
from mtp_edge.exporter.platform import (
    AUTO_KS,
    DEFAULT_K,
    ExportOptions,
    auto_candidates,
    resolve_options,
)
from mtp_edge.manifest import Manifest
from mtp_edge.platforms import PLATFORMS, Platform


def row(label, runs, ppl=1.0, size=100.0, lossless=True) -> dict:
    return {
        "label": label,
        "spec_tok_s_runs": runs,
        "perplexity_ratio": ppl,
        "size_mb": size,
        "lossless": lossless,
    }


def median(r: dict) -> float:
    return statistics.median(r["spec_tok_s_runs"])


# --- the rule ------------------------------------------------------------------------------


def test_the_fastest_wins_when_ahead_by_more_than_the_spread():
    rows = [row("8da8w k=4", [80, 82, 81], 1.01, 160), row("fp32 k=3", [95, 97, 96], 1.0, 540)]
    choice = pick(rows)
    assert choice["chosen"] == 1 and choice["spread"] == 2
    assert "fp32 k=3 decoded fastest" in choice["why"]


def test_a_near_tie_goes_to_perplexity_then_size():
    # 8da8w is fastest (median 90) but fp32 (88) is within the spread (4): better perplexity wins.
    rows = [row("8da8w", [88, 90, 92], 1.012, 160), row("fp32", [87, 88, 89], 1.0, 540)]
    choice = pick(rows)
    assert choice["chosen"] == 1 and choice["spread"] == 4
    assert "best perplexity" in choice["why"]
    # Same perplexity (two k of one scheme... or equal schemes): the smaller bundle.
    rows = [row("a", [88, 90, 92], 1.0, 540), row("b", [87, 88, 89], 1.0, 160)]
    assert pick(rows)["chosen"] == 1
    # Same perplexity and size (k candidates of one export): the faster median.
    rows = [row("k=3", [88, 90, 92], 1.0, 160), row("k=4", [87, 88, 89], 1.0, 160)]
    assert pick(rows)["chosen"] == 0


def test_out_of_bound_or_lossy_candidates_are_never_chosen():
    rows = [
        row("8da4w", [150, 151, 152], 1.59, 100),  # fastest, but 59% more perplexity
        row("lossy", [140, 141, 142], 1.0, 100, lossless=False),
        row("8da8w", [80, 81, 82], 1.012, 160),
    ]
    choice = pick(rows)
    assert choice["chosen"] == 2
    assert set(choice["excluded"]) == {0, 1}
    assert f"perplexity x1.590 > x{QUALITY_BOUND}" in choice["excluded"][0]
    assert pick([rows[0]])["chosen"] is None


def test_a_candidate_out_of_the_bound_is_not_timed_and_says_why():
    """The search does not time a candidate whose perplexity is out of the bound: its row has
    no timing, the rule names the perplexity as the reason, and the table prints dashes."""
    from types import SimpleNamespace

    from mtp_edge.exporter.choose import candidate_row, table

    manifest = SimpleNamespace(
        models={"target": SimpleNamespace(quant={"scheme": "8da4w-mix", "group_size": 32})},
        quality={"perplexity_ratio": 1.29},
    )
    untimed = candidate_row("8da4w-mix", 3, manifest, 120.0, None)
    assert untimed["spec_tok_s_runs"] == [] and untimed["tau"] is None
    rows = [untimed, row("8da8w k=3", [80, 81, 82], 1.012, 160)]
    choice = pick(rows)
    assert choice["chosen"] == 1
    assert choice["excluded"] == {0: f"perplexity x1.290 > x{QUALITY_BOUND}"}
    lines = table(rows, choice)
    assert lines[1].split()[:4] == ["8da4w-mix", "k=3", "x1.290", "120"]
    assert "-" in lines[1].split() and lines[2].endswith("<- chosen")


def test_never_below_another_candidate_by_more_than_the_spread():
    generator = random.Random(7)
    for _ in range(500):
        rows = []
        for i in range(generator.randint(1, 8)):
            level = generator.uniform(20, 200)
            runs = [level + generator.uniform(-8, 8) for _ in range(generator.randint(1, 4))]
            ppl = generator.choice([1.0, 1.003, 1.012, 1.03, 1.06, 1.59])
            size = generator.choice([80.0, 160.0, 540.0])
            rows.append(row(f"c{i}", runs, ppl, size, lossless=generator.random() > 0.1))
        choice = pick(rows)
        eligible = [i for i in range(len(rows)) if i not in choice["excluded"]]
        if not eligible:
            assert choice["chosen"] is None
            continue
        chosen = rows[choice["chosen"]]
        assert chosen["perplexity_ratio"] <= QUALITY_BOUND and chosen["lossless"]
        spreads = [
            max(rows[i]["spec_tok_s_runs"]) - min(rows[i]["spec_tok_s_runs"]) for i in eligible
        ]
        assert choice["spread"] == pytest.approx(max(spreads), abs=1e-3)
        fastest = max(median(rows[i]) for i in eligible)
        assert fastest - median(chosen) <= choice["spread"] + 1e-3
        # and among the near-ties it is the best by (perplexity, size, speed)
        near = [i for i in eligible if fastest - median(rows[i]) <= choice["spread"] + 1e-9]
        best = min(
            near,
            key=lambda i: (rows[i]["perplexity_ratio"], rows[i]["size_mb"], -median(rows[i])),
        )
        assert choice["chosen"] == best


# --- options -------------------------------------------------------------------------------


def test_auto_candidates_and_refusals(monkeypatch):
    auto = ExportOptions(quant="auto")
    assert resolve_options(auto, lambda _: None) == auto  # left to the search
    every = list(PLATFORMS["android"].schemes)
    # Our kernels' schemes are candidates where the CPU's int8 path is AVX2's only.
    monkeypatch.setenv("MTP_EDGE_INT8_PATH", "avx2")
    assert auto_candidates(auto) == (every, list(AUTO_KS))
    monkeypatch.setenv("MTP_EDGE_INT8_PATH", "avx512-vnni")
    without = [s for s in every if s not in ("8da8w-avx2", "8da4w-mix-avx2")]
    assert auto_candidates(auto) == (without, list(AUTO_KS))
    assert auto_candidates(replace(auto, k=3)) == (without, [3])
    # k is baked into the verify method with ExecuTorch's attention op, and without a drafter
    # it means nothing: not searched.
    assert auto_candidates(replace(auto, attention_kernel="executorch"))[1] == [DEFAULT_K]
    assert auto_candidates(replace(auto, drafter="none"))[1] == [DEFAULT_K]
    # Core ML exports one verification width: k is not searched there either.
    assert auto_candidates(ExportOptions(platform="coreml", quant="auto"))[1] == [DEFAULT_K]
    assert resolve_options(ExportOptions(), lambda _: None).k == DEFAULT_K
    for wrong, fragment in [
        (replace(auto, group_size=32), "--group-size cannot be combined with --quant auto"),
        (replace(auto, quality_tokens=0), "leave --quality-tokens above 0"),
        (replace(auto, auto_schemes=("int4",)), "--quant int4 is not available"),
        (ExportOptions(auto_schemes=("fp32",)), "candidates of quant='auto' only"),
        (replace(auto, k=16), "--k must be in 1..15"),
    ]:
        with pytest.raises(UserError, match=fragment):
            resolve_options(wrong, lambda _: None)


def test_head_quant_is_androids_and_not_with_auto():
    six = ExportOptions(quant="8da4w-mix-avx2", head_quant="8da6w-avx2")
    assert resolve_options(six, lambda _: None).head_quant == "8da6w-avx2"
    for wrong, fragment in [
        (replace(six, platform="onnx", quant="8da4w"), "--head-quant is for --target android"),
        (replace(six, quant="auto"), "--head-quant cannot be combined with --quant auto"),
        (replace(six, head_quant="int4"), "--head-quant int4 is not a head scheme: choose one"),
    ]:
        with pytest.raises(UserError, match=fragment):
            resolve_options(wrong, lambda _: None)


def test_one_scheme_and_a_given_k_is_no_search(monkeypatch):
    solo = Platform(
        name="solo",
        summary="one scheme",
        backend="solort",
        exporter="mtp_edge.exporter.executorch",
        session="mtp_edge.runtime.executorch_session",
        schemes=("fp32",),
        default_scheme="fp32",
        why_default="the only one",
    )
    monkeypatch.setitem(PLATFORMS, "solo", solo)
    said: list[str] = []
    options = resolve_options(ExportOptions(platform="solo", quant="auto", k=3), said.append)
    assert (options.quant, options.k, options.group_size) == ("fp32", 3, 0)
    assert said == [
        "[quantize] auto: --target solo has one scheme, fp32, and k is 3: nothing to measure"
    ]
    # k left open is still measured
    assert (
        resolve_options(ExportOptions(platform="solo", quant="auto"), said.append).quant == "auto"
    )


def test_the_cli_refuses_in_one_line(tiny_dir, tmp_path):
    out = tmp_path / "b"
    args = ["-m", str(tiny_dir), "-o", str(out), "--quant", "auto", "--group-size", "32"]
    result = CliRunner().invoke(mtp_export, args)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [
        "error: --group-size cannot be combined with --quant auto, which measures each scheme "
        "at its default group size: drop --group-size, or choose the scheme with --quant"
    ]
    assert not out.exists()


# --- a search ------------------------------------------------------------------------------


def test_a_search_of_two_schemes_records_both_and_keeps_the_rule_s_choice(
    tiny_dir, tmp_path, monkeypatch
):
    """8da8w and fp32 of the tiny model, k=2: both exported, both timed (two worker processes,
    two passes of the suite's first prompt per category, 6 new tokens), the manifest records
    both rows, and the bundle is the candidate `pick` chooses from the recorded table."""
    from mtp_edge.api import export

    monkeypatch.setattr(choose, "PLAN", SearchPlan(per_category=1, max_new_tokens=6, repeat=2))
    out = tmp_path / "auto"
    said: list[str] = []
    options = ExportOptions(
        model=str(tiny_dir),
        quant="auto",
        auto_schemes=("8da8w", "fp32"),
        k=2,
        drafter="ngram",
        max_seq_len=256,  # prompts that do not fit with their answers are left out
        quality_tokens=64,
    )
    bundle, manifest = export(options, out, said.append)
    assert bundle == out and sorted(p.name for p in tmp_path.iterdir()) == ["auto"]
    assert not (out / "candidates").exists()
    loaded = Manifest.load(out)  # hashes and all
    auto = loaded.quality["auto"]
    rows = auto["candidates"]
    assert [r["label"] for r in rows] == ["8da8w k=2", "fp32 k=2"]
    for r in rows:
        assert len(r["spec_tok_s_runs"]) == 2 and len(r["plain_tok_s_runs"]) == 2
        assert r["lossless"] and r["tau"] >= 1 and r["size_mb"] > 0
        assert r["perplexity_ratio"] == pytest.approx(1.0, abs=0.05)
    assert rows[1]["size_mb"] > rows[0]["size_mb"]  # float weights: four times the bytes
    choice = pick(rows, auto["bound"])
    chosen = rows[choice["chosen"]]
    assert auto["chosen"] == {
        "scheme": chosen["scheme"],
        "group_size": chosen["group_size"],
        "k": 2,
    }
    assert auto["spread_tok_s"] == choice["spread"] and auto["why"] == choice["why"]
    assert loaded.models["target"].quant["scheme"] == chosen["scheme"]
    assert loaded.drafter.k == 2
    fastest = max(median(r) for r in rows)
    assert fastest - median(chosen) <= auto["spread_tok_s"] + 1e-6
    assert any(
        line.startswith("[auto] 2 schemes (8da8w, fp32)") and "in all" in line for line in said
    )
    assert any("<- chosen" in line for line in said)


def test_a_search_whose_candidates_are_all_out_of_the_bound_times_nothing(
    tiny_dir, tmp_path, monkeypatch
):
    """The candidate exported, not within a bound below any perplexity: none of its k is
    timed, the search says so and ends in one error, and nothing is left behind."""
    import mtp_edge.api
    from mtp_edge.api import export

    def no_timer(progress):
        def timer(setups, plan):
            raise AssertionError(f"timed {setups}")

        return timer

    monkeypatch.setattr(mtp_edge.api, "auto_timer", no_timer)
    monkeypatch.setattr(choose, "QUALITY_BOUND", 0.5)
    out = tmp_path / "auto"
    said: list[str] = []
    options = ExportOptions(
        model=str(tiny_dir),
        quant="auto",
        auto_schemes=("8da8w",),  # one export, k = 2..5 left to the search
        drafter="ngram",
        max_seq_len=256,
        quality_tokens=64,
    )
    with pytest.raises(UserError, match="no candidate was within the perplexity bound"):
        export(options, out, said.append)
    assert "[auto] not timed, perplexity above x0.5 of fp32: 8da8w" in said
    assert sum("(perplexity x" in line and "> x0.5)" in line for line in said) == len(AUTO_KS)
    assert not out.exists() and list(tmp_path.iterdir()) == []
