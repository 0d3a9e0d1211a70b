"""Who writes and labels the text: int8 or fp32 chosen by measuring this machine's matmuls at
the target's shapes (a slow int8 path, as on an AVX2-only x86 CPU, is simulated by injecting
the probe's measurement); --writer/--labeller still force one; a resumed run keeps its choice."""

from __future__ import annotations

import pytest
from tiny import hf_reference, save_hf_dir

from mtp_edge.checkpoints import load_model
from mtp_edge.machine import INT8_PATHS
from mtp_edge.mtp import target_fingerprint
from mtp_edge.train import TrainOptions, engines
from mtp_edge.train.int8 import Int8Transformer


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("paths")
    save_hf_dir(hf_reference("llama", hidden_size=32, intermediate_size=64), root / "model")
    return load_model(str(root / "model"))


def options(tmp_path, **overrides) -> TrainOptions:
    return TrainOptions(out=str(tmp_path / "heads.safetensors"), steps=1, **overrides)


def test_the_probe_times_both_paths(loaded):
    for rows in (1, 16):
        measured = engines.probe_paths(loaded.model, rows)
        assert set(measured) == {"int8", "fp32"} and min(measured.values()) > 0


def test_a_slices_fixed_cost_is_not_scaled_with_the_weight():
    """A call's fixed cost (int8's activation quantization, the dispatch) is paid once whatever
    the weight's rows: the time on a large weight follows the line through two slices' times,
    not one slice's time scaled by the rows, which once made int8 look slower than fp32 where
    it writes 2.5x faster."""
    fixed, per_row = 2e-4, 1e-7

    def timed(n):
        return fixed + per_row * n

    times = {256: timed(256), 1024: timed(1024)}
    assert engines.full_size_seconds(times, 49152) == pytest.approx(timed(49152))
    assert engines.full_size_seconds({64: 3e-5}, 64) == 3e-5  # a weight timed whole
    # Noise that tilts the line below zero leaves the small slice's time, never a negative one.
    assert engines.full_size_seconds({256: 2e-4, 1024: 1e-4}, 4096) == pytest.approx(2e-4)


def test_the_rule():
    assert engines.choose({"int8": 1.0, "fp32": 3.0})[0] == "int8"
    path, why = engines.choose({"int8": 14.0, "fp32": 1.0})
    assert path == "fp32" and "14.0x slower" in why
    # The words name the CPU's int8 path by its flags; the choice stays the measurement's.
    path, why = engines.choose({"int8": 14.0, "fp32": 1.0}, INT8_PATHS["avx2"])
    assert path == "fp32" and why.endswith("(this CPU's int8 path: avx2, no int8 dot product)")
    path, why = engines.choose({"int8": 3.1, "fp32": 1.0}, INT8_PATHS["avx512-vnni"])
    assert path == "fp32" and "although this CPU has an int8 dot product (avx512-vnni)" in why
    assert engines.choose({"int8": 1.0, "fp32": 1.05})[0] == "fp32"  # a near tie: the exact one


@pytest.mark.parametrize("int8_s, expected", [(1e-4, "int8"), (5e-3, "fp32")])
def test_a_slow_int8_path_flips_the_choice(loaded, tmp_path, monkeypatch, int8_s, expected):
    asked = []

    def measured(target, rows):
        asked.append(rows)
        return {"int8": int8_s, "fp32": 1e-3}

    monkeypatch.setattr(engines, "probe_paths", measured)
    opts = options(tmp_path, gen_batch=8)
    assert (opts.writer, opts.labeller) == ("auto", "auto")
    lines: list[str] = []
    chosen = engines.set_up_engines(opts, loaded, lines.append, {})
    assert (opts.writer, opts.labeller) == (expected, expected)
    assert asked == [8, engines.PROBE_LABEL_ROWS]  # a writing step's rows, a sequence's
    fingerprint = target_fingerprint(loaded.model)
    if expected == "int8":
        assert isinstance(chosen.writer, Int8Transformer) and chosen.labeller is chosen.writer
        assert chosen.label_hash == chosen.text_hash == "int8-" + fingerprint
    else:
        assert chosen.writer is loaded.model and chosen.labeller is loaded.model
        assert chosen.label_hash == chosen.text_hash == fingerprint
        assert any(line.startswith("writer: fp32 (int8 matmuls 5.0x slower") for line in lines)
    assert any(line.startswith("labeller: " + expected) for line in lines)  # printed, with why


def test_forced_or_resumed_choices_are_not_measured(loaded, tmp_path, monkeypatch):
    def measured(target, rows):
        raise AssertionError("measured though the path was given")

    monkeypatch.setattr(engines, "probe_paths", measured)
    opts = options(tmp_path, writer="int8", labeller="fp32")
    chosen = engines.set_up_engines(opts, loaded, print, {})
    assert isinstance(chosen.writer, Int8Transformer) and chosen.labeller is loaded.model
    resumed = options(tmp_path)
    lines: list[str] = []
    engines.set_up_engines(resumed, loaded, lines.append, {"writer": "int8", "labeller": "int8"})
    assert (resumed.writer, resumed.labeller) == ("int8", "int8")
    assert "writer: int8, as the run being resumed chose" in lines
