"""An export never holds a float copy of the model: each part is quantized as it is read, and
the exportable program shares those weights. Checked on a tiny model scaled up until its float
weights (~200 MB) stand far above the noise of a process's resident memory, through the stage
log every export writes into its manifest (peak resident memory per stage)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.tiny import hf_reference, save_hf_dir

VOCAB = 4096


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """A qwen2 model with ~50M parameters (200 MB in float32): a tied embedding (4096 x 1024)
    and 4 layers of width 1024 (11.5M parameters each): holding all layers in float32 shows,
    holding one does not."""
    reference = hf_reference(
        "qwen2",
        tied=True,
        vocab=VOCAB,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    float_bytes = sum(p.numel() for p in reference.parameters()) * 4
    directory = save_hf_dir(reference, tmp_path_factory.mktemp("wide"), vocab=VOCAB)
    return directory, float_bytes


def test_export_stages_hold_no_float_copy(wide_model_dir, tmp_path):
    model_dir, float_bytes = wide_model_dir
    float_mb = float_bytes / 1e6
    out = tmp_path / "bundle"
    # A process of its own: its resident memory is this export's and nothing the tests left.
    command = [
        sys.executable, "-c", "from mtp_edge.cli.export import export; export()",
        "--target", "android", "-m", str(model_dir), "--drafter", "none",
        "--quality-tokens", "256", "-c", "256", "-o", str(out), "-q",
    ]  # fmt: skip
    subprocess.run(command, check=True, timeout=900)
    manifest = json.loads((out / "manifest.json").read_text())
    log = manifest["export_log"]
    stages = {row["stage"]: row for row in log["stages"]}
    assert "load, quantize, fp32 perplexity" in stages, list(stages)
    assert manifest["quality"]["perplexity_fp32_method"].startswith("streamed")
    assert manifest["quality"]["perplexity_ratio"] < 1.2  # the streamed reference is the model's
    load = stages["load, quantize, fp32 perplexity"]
    # Quantized (int8 weights: ~0.25 of float) plus one layer in float and torchao's
    # temporaries: ~0.5 measured; the float model alone would be 1.0.
    grown = load["peak_rss_mb"] - load["rss_before_mb"]
    assert grown < 0.75 * float_mb, (grown, float_mb, log)
    # Loading and lowering ran in a child process (its rows carry what the parent held then),
    # so the parent starts the quality checks without the model or what lowering left.
    assert all("other_mb" in stages[name] for name in ("load, quantize, fp32 perplexity", "export"))
    assert stages["quality checks"]["rss_before_mb"] < stages["export"]["rss_before_mb"]
    peaks = [row["peak_rss_mb"] + row.get("other_mb", 0) for row in log["stages"]]
    assert log["peak_rss_mb"] == max(peaks)
    # The forecast an export prints before it starts sizes the program from the shapes alone.
    from mtp_edge.config import ModelConfig
    from mtp_edge.memory import program_gb

    config = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    predicted = program_gb(config, "8da8w", 0, "8w")
    written = (out / "target.pte").stat().st_size / 1e9
    assert abs(predicted - written) < 0.1 * written, (predicted, written)


def test_export_warns_before_it_starts_when_memory_is_short(monkeypatch):
    from mtp_edge import memory
    from mtp_edge.api import ExportOptions
    from mtp_edge.config import ModelConfig
    from mtp_edge.exporter.pipeline import forecast_memory

    # Qwen2.5-1.5B's shapes: a 1.78 GB program at 8da8w and a 0.12 GB cache of 2048 positions,
    # measured peak 5.97 GB.
    config = ModelConfig(
        arch="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, tie_word_embeddings=True,
    )  # fmt: skip
    OPTIONS = ExportOptions(quant="8da8w", group_size=0)  # noqa: N806 (android's default)
    said: list[str] = []
    monkeypatch.setattr(memory, "available_gb", lambda: 20.0)
    forecast_memory(OPTIONS, config, 2048, said.append)
    assert len(said) == 1 and "1.78 GB target program, a 0.12 GB cache" in said[0], said
    peak = float(said[0].split("~")[1].split(" GB")[0])
    assert 5.0 < peak < 7.0, said
    said.clear()
    monkeypatch.setattr(memory, "available_gb", lambda: 4.0)
    warned: list[str] = []
    forecast_memory(OPTIONS, config, 2048, said.append, warned.append)
    assert len(said) == 1 and len(warned) == 1, (said, warned)
    assert warned[0].startswith("[memory] warning:"), warned
    assert "--quant 8da4w" in warned[0]


@pytest.mark.parametrize("tied", [True, False])
def test_quantizing_while_loading_equals_quantizing_the_loaded_model(tmp_path, tied, monkeypatch):
    """The export's loader hook, quantizing vocabulary tables a block of rows at a time, gives
    every weight exactly what torchao gives the whole float model (the tied LM head included)."""
    import torch

    from mtp_edge.checkpoints import load_model, open_checkpoint
    from mtp_edge.exporter.executorch import load_hook
    from mtp_edge.exporter.platform import ExportOptions
    from mtp_edge.quantize import schemes
    from mtp_edge.quantize.schemes import QuantScheme, quantize_model

    model_dir = save_hf_dir(hf_reference("qwen2", tied=tied), tmp_path)
    for quant, group in (("8da8w", 0), ("8da4w", 32)):
        monkeypatch.setattr(schemes, "QUANTIZE_ROWS", 40)  # the 97-token tables in 3 blocks
        options = ExportOptions(model=str(model_dir), quant=quant, group_size=group)
        hook = load_hook(options, open_checkpoint(str(model_dir)).skeleton())
        streamed = load_model(str(model_dir), on_part=hook).model
        monkeypatch.setattr(schemes, "QUANTIZE_ROWS", 10**9)  # torchao on each whole table
        whole = quantize_model(
            load_model(str(model_dir)).model, QuantScheme(quant, group, options.embedding_quant)
        )
        ours, theirs = dict(streamed.named_parameters()), dict(whole.named_parameters())
        assert ours.keys() == theirs.keys()
        assert streamed.lm_head is not None  # its own quantized copy, also when tied
        for name, weight in theirs.items():
            assert type(ours[name]) is type(weight), name
            if name.endswith("proj.weight") or name in ("embed_tokens.weight", "lm_head.weight"):
                assert type(weight) is not torch.nn.Parameter, name  # quantized
            for part in (
                weight.__tensor_flatten__()[0] if hasattr(weight, "__tensor_flatten__") else ()
            ):
                assert torch.equal(getattr(ours[name], part), getattr(weight, part)), (name, part)
            if not hasattr(weight, "__tensor_flatten__"):
                assert torch.equal(ours[name], weight), name


def test_the_exportable_copy_shares_the_quantized_weights(tmp_path):
    """exportable_copy swaps modules on a copy but never copies a weight: lowering then holds
    the quantized model once, not a second (or float) copy of it."""
    from mtp_edge.checkpoints import load_model, open_checkpoint
    from mtp_edge.exporter.executorch import exportable_copy, load_hook
    from mtp_edge.exporter.platform import ExportOptions, resolve_options
    from mtp_edge.quantize.schemes import QuantScheme

    model_dir = str(save_hf_dir(hf_reference("qwen2", tied=True), tmp_path))
    options = resolve_options(ExportOptions(model=model_dir), progress=lambda _: None)
    model = load_model(model_dir, on_part=load_hook(options, open_checkpoint(model_dir).skeleton()))
    scheme = QuantScheme(options.quant, options.group_size, options.embedding_quant)
    copy = exportable_copy(model.model, scheme, 64)
    originals = {id(p) for p in model.model.parameters()}
    copied = list(copy.parameters())
    assert copied and all(id(p) in originals for p in copied)
    assert copy.layers[0].self_attn is not model.model.layers[0].self_attn  # modules swapped


def test_a_warning_shows_with_quiet(capsys):
    from mtp_edge import logs

    quiet = logs.is_quiet()
    logs.set_verbosity(quiet=True)
    try:
        logs.say("progress")
        logs.warn("[memory] warning: short")
    finally:
        logs.set_verbosity(quiet=quiet)
    err = capsys.readouterr().err
    assert "progress" not in err and "[memory] warning: short" in err, err
