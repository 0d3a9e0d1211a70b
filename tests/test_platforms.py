"""The platform table (mtp_edge/platforms.py): a new platform is a row and its two modules.

Here the row is added by the test and both modules are this file: a toy platform whose bundle
names the checkpoint it was exported from and whose backend runs it on the eager model. The
CLI's choices, the schemes, the manifest, the runtime's backends and the harness's hooks take
it from the row alone; an export to it decodes what the eager model decodes.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from mtp_edge.cli import export as mtp_export
from mtp_edge.cli import run
from mtp_edge.errors import UserError
from mtp_edge.exporter.platform import ExportOptions, resolve_options
from mtp_edge.manifest import Manifest, ModelFile
from mtp_edge.platforms import PLATFORMS, Platform, every_scheme, platform

TOY = Platform(
    name="toy",
    summary="the checkpoint's path, run on the eager model",
    backend="toyrt",
    exporter=__name__,
    session=__name__,
    schemes=("fp32", "fp16"),
    default_scheme="fp32",
    why_default="fp32: the toy keeps the checkpoint as it is",
    blockwise=("fp16",),  # only so that a block size is checked for one of its schemes
)


# --- the toy's exporter module (exporter/platform.py's two functions) ---------------------


def check(job) -> None:
    if job.drafter_kind not in ("none", "ngram"):
        raise UserError("--target toy carries no model drafter: use --drafter ngram or none")


def export(job, directory: Path):
    (directory / "target.json").write_text(json.dumps({"source": str(job.target.path)}))
    quant = {"scheme": job.options.quant, "group_size": job.options.group_size}
    return {"target": ModelFile("target.json", "", quant, {})}, {}


# --- the toy's session module (runtime/backends.py's entry points) ------------------------


def available() -> bool:
    return True


def open_program(path: Path, max_seq_len: int, max_chunk: int):
    from mtp_edge.checkpoints import load_model
    from mtp_edge.runtime.session import EagerSession

    source = json.loads(Path(path).read_text())["source"]
    return EagerSession(load_model(source).model, max_seq_len, max_chunk)


def open_target(bundle):
    m = bundle.manifest
    return open_program(bundle.path / m.models["target"].file, m.max_seq_len, m.max_chunk)


def open_mtp_step(bundle, target):
    raise UserError("toy bundles carry no MTP heads")


def open_draft_model(bundle):
    raise UserError("toy bundles carry no draft model")


# --- the tests ---------------------------------------------------------------------------


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(PLATFORMS, "toy", TOY)
    return TOY


def test_the_rows_are_complete():
    """Every row names importable-looking modules, and its default among its schemes."""
    for row in PLATFORMS.values():
        assert row.default_scheme in row.schemes and row.why_default
        assert row.exporter.startswith("mtp_edge.exporter.")
        assert row.session.startswith("mtp_edge.runtime.")
    assert len({row.backend for row in PLATFORMS.values()}) == len(PLATFORMS)


def test_options_are_decided_below_the_cli():
    """The API picks the platform's default scheme and group size, as mtp-export does."""
    said: list[str] = []
    onnx = resolve_options(ExportOptions(platform="onnx"), said.append)
    assert (onnx.quant, onnx.group_size, onnx.draft_quant) == ("int4", 32, "int4")
    assert said == [f"[quantize] default {platform('onnx').why_default}"]
    android = resolve_options(ExportOptions(), lambda _: None)
    assert (android.quant, android.group_size, android.draft_quant) == ("8da8w", 0, "8da8w")
    given = ExportOptions(platform="onnx", quant="int8", draft_quant="int4", group_size=64)
    # k: DEFAULT_K; both schemes in blocks on onnx: the drafter's blocks are the target's
    assert resolve_options(given, said.append) == replace(given, k=4, draft_group_size=64)
    for wrong, fragment in [
        (ExportOptions(platform="onnx", quant="8da8w"), "int4, int8, fp32"),
        (ExportOptions(platform="onnx", group_size=24), "power of two"),
        (ExportOptions(k=0), "--k must be in 1..15"),
        (ExportOptions(platform="fpga"), "choose one of android, onnx, coreml"),
    ]:
        with pytest.raises(UserError, match=fragment):
            resolve_options(wrong, lambda _: None)


def test_a_drafter_scheme_that_groups_otherwise_gets_its_own_group_size():
    """--group-size is the target's; a drafter whose scheme groups its weights otherwise (8-bit
    per channel beside 4-bit in groups, and the reverse) gets its scheme's default, not an
    error about a group size the user never gave, nor 4-bit weights per channel."""

    def draft(**given):
        resolved = resolve_options(ExportOptions(**given), lambda _: None)
        return resolved.group_size, resolved.draft_group_size

    assert draft(quant="8da4w", draft_quant="8da8w") == (32, 0)
    assert draft(quant="8da8w", draft_quant="8da4w") == (0, 32)
    assert draft(quant="8da4w", draft_quant="8da4w-mix", group_size=64) == (64, 64)
    assert draft(quant="8da4w-mix-avx2", draft_quant="8da8w-avx2") == (32, 0)
    assert draft(quant="8da8w") == (0, 0)


def test_a_new_row_is_a_choice_scheme_and_backend(toy):
    from mtp_edge.quantize.schemes import check_platform_scheme, default_group_size
    from mtp_edge.runtime.backends import backend, decoding_threads

    options = {p.name: p for p in mtp_export.params}
    assert "toy" in options["platform"].type.choices
    assert "fp16" in every_scheme() and "fp16" in options["quant"].type.choices
    assert default_group_size("fp16", "toy") == 32 and default_group_size("fp32", "toy") == 0
    with pytest.raises(UserError, match="--target toy: choose one of fp32, fp16"):
        check_platform_scheme("toy", "8da8w", 0)
    with pytest.raises(UserError, match="power of two"):
        check_platform_scheme("toy", "fp16", 24)
    assert backend("toyrt").open_target is open_target
    import torch

    assert decoding_threads("toyrt") == torch.get_num_threads()  # no threads hook declared


def test_an_export_to_the_new_row_decodes_as_the_eager_model(toy, tiny_dir, tmp_path):
    from mtp_edge.devices.cost import bundle_cost

    out = tmp_path / "toy-bundle"
    args = ["--target", "toy", "-m", str(tiny_dir), "-o", str(out), "-c", "64"]
    result = CliRunner().invoke(mtp_export, [*args, "--quality-tokens", "24", "--drafter", "ngram"])
    assert result.exit_code == 0, result.output
    assert f"[quantize] default {TOY.why_default}" in result.stderr
    manifest = Manifest.load(out)
    assert (manifest.platform, manifest.backend) == ("toy", "toyrt")
    assert manifest.models["target"].quant == {"scheme": "fp32", "group_size": 0}
    assert manifest.quality["perplexity_ratio"] == 1.0  # the same model, run twice
    assert "exported" in manifest.quality["drafter_acceptance"]  # measured on the toy backend

    common = ["--prompt", "the cat the cat the cat", "--no-chat-template", "--json", "-"]
    common += ["--max-new-tokens", "12"]
    ran = CliRunner().invoke(run, ["--bundle", str(out), *common])
    eager = CliRunner().invoke(run, ["-m", str(tiny_dir), "-c", "64", "--drafter", "none", *common])
    assert ran.exit_code == 0 and eager.exit_code == 0, ran.output + eager.output
    assert json.loads(ran.stdout)["token_ids"] == json.loads(eager.stdout)["token_ids"]
    with pytest.raises(UserError, match="mtp-predict reads bundles for executorch"):
        bundle_cost(out)  # no `predictable` hook declared


def test_an_older_bundle_says_re_export(toy, tiny_dir, tmp_path):
    """A format-1 manifest (its platform under "target") is refused in one line."""
    out = tmp_path / "toy-bundle"
    args = ["--target", "toy", "-m", str(tiny_dir), "-o", str(out), "-c", "32"]
    result = CliRunner().invoke(mtp_export, [*args, "--quality-tokens", "0", "--drafter", "none"])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "manifest.json").read_text())
    assert data["platform"] == "toy" and "target" not in data and data["format_version"] == 2
    data["target"] = data.pop("platform")
    data["format_version"] = 1
    (out / "manifest.json").write_text(json.dumps(data))
    ran = CliRunner().invoke(run, ["--bundle", str(out), "--prompt", "x"])
    assert ran.exit_code == 2
    assert ran.stderr.strip().splitlines() == [
        f"error: bundle {out} has format version 1, this runtime reads 2: re-export it with "
        "this version of mtp-export"
    ]


def test_resolved_options_cross_to_the_child_unchanged():
    """The child process rebuilds ExportOptions from the parent's resolved fields."""
    from dataclasses import asdict

    options = resolve_options(ExportOptions(platform="onnx"), lambda _: None)
    assert ExportOptions(**asdict(options)) == options
