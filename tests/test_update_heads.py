"""mtp-export --update-heads: refined heads swapped into a bundle without exporting its target
again (exporter/update_heads.py). The bundles are conftest.py's shared ones, edited as copies."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tiny import save_random_heads

from mtp_edge.checkpoints import load_model
from mtp_edge.cli import export, run
from mtp_edge.errors import UserError
from mtp_edge.manifest import Manifest, sha256
from mtp_edge.mtp import MTPConfig, MTPHead, init_from_target, load_heads, save_heads
from mtp_edge.runtime.backends import backend
from mtp_edge.runtime.bundle import bundle_drafter, open_bundle, target_session

TOKENS = [5, 17, 33, 2, 41, 8, 60, 12]


@pytest.fixture(autouse=True)
def hash_every_file(monkeypatch):
    """Every check hashes every file: no verified-once stamp hides a change."""
    monkeypatch.setenv("MTP_EDGE_VERIFY", "always")


def refined_heads(bundle: Path, path: Path, seed: int = 1, draft_tokens: int = 48) -> Path:
    """Heads for the bundle's model other than the ones it carries: other weights (`seed`) and
    another draft vocabulary (the lowest `draft_tokens` ids, where the bundle's are the top)."""
    source = Manifest.load(bundle).source["path"]
    target = load_model(source)
    c = target.config
    config = MTPConfig(
        c.hidden_size,
        2 * c.hidden_size,
        c.vocab_size,
        draft_tokens,
        target_name=target.name,
        target_hash=target.fingerprint,
        recipe={"seconds": 1.0, "heldout_tau": 1.5},
    )
    torch.manual_seed(seed)
    head = MTPHead(config)
    init_from_target(head, target.model, torch.arange(draft_tokens))
    save_heads(head, config, path)
    return path


def update(*args: str):
    return CliRunner().invoke(export, ["--update-heads", *map(str, args)])


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def logits_of(bundle: Path) -> torch.Tensor:
    return target_session(open_bundle(bundle)).forward(TOKENS, 0).logits


def drafts_of(bundle: Path, h: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """One draft step of the bundle's drafter program, its logits over the draft vocabulary."""
    opened = open_bundle(bundle)
    step, _ = backend(opened.manifest.backend).open_mtp_step(opened, lambda: target_session(opened))
    return step(h, token)[0].flatten()


def eager_drafts(heads: Path, bundle: Path, h: torch.Tensor, token: torch.Tensor):
    target = load_model(Manifest.load(bundle).source["path"])
    head = load_heads(heads, target.model, target.name).float()
    with torch.no_grad():
        return head.step(h, target.model.embed_tokens(token))[0].flatten()


def lossless(bundle: Path) -> None:
    """Greedy speculative decoding with the bundle's heads gives plain decoding's tokens."""

    def tokens(drafter: str) -> dict:
        args = ["--bundle", str(bundle), "--prompt", "the cat sat on", "--no-chat-template"]
        args += ["--json", "-", "--max-new-tokens", "40", "--draft-confidence", "0"]
        result = CliRunner().invoke(run, [*args, "--drafter", drafter])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    plain, speculative = tokens("none"), tokens("mtp")
    assert speculative["token_ids"] == plain["token_ids"]
    assert speculative["stats"]["drafted_tokens"] > 0


@pytest.mark.parametrize("kind", ["android", "onnx"])
def test_heads_update_in_place(kind, mtp_bundle_of, onnx_mtp_bundle, copy_bundle, tmp_path):
    shared = mtp_bundle_of("none") if kind == "android" else onnx_mtp_bundle
    bundle = copy_bundle(shared, "bundle")
    before = Manifest.load(bundle)
    heads = refined_heads(bundle, tmp_path / "refined.safetensors")

    result = update(bundle, "--heads", heads)

    assert result.exit_code == 0, result.output
    after = Manifest.load(bundle)  # every hash checked
    assert after.models["target"] == before.models["target"]
    assert file_sha(bundle / after.models["target"].file) == before.models["target"].sha256
    assert after.models["drafter"].sha256 != before.models["drafter"].sha256
    assert after.drafter.draft_vocab_size == 48
    assert after.drafter.recipe["heads_sha256"] == sha256(heads)
    assert after.drafter.recipe["heldout_tau"] == 1.5
    assert (after.drafter.k, after.drafter.lookup) == (before.drafter.k, before.drafter.lookup)
    assert "drafter_acceptance" not in after.quality
    assert json.loads(result.stdout.splitlines()[-1])["bundle"] == str(bundle)
    assert not list(tmp_path.glob(".bundle.*"))  # no temporary directory left beside it
    # The target computes what it did, the drafter what the new heads compute.
    assert torch.equal(logits_of(bundle), logits_of(shared))
    d = after.drafter.hidden_size
    torch.manual_seed(0)
    h, token = torch.randn(1, d), torch.tensor([7])
    new, old = eager_drafts(heads, bundle, h, token), drafts_of(shared, h, token)
    drafted = drafts_of(bundle, h, token)
    assert drafted.shape == new.shape != old.shape
    tolerance = 1e-4 if kind == "onnx" else 0.05  # fp32 graph; 8da4w program (8-bit inputs)
    torch.testing.assert_close(drafted, new, atol=tolerance * new.abs().max(), rtol=0)
    vocab = json.loads((bundle / "drafter_vocab.json").read_text())["draft_ids"]
    assert vocab == list(range(48))
    assert bundle_drafter(open_bundle(bundle)) is not None
    lossless(bundle)


def test_an_updated_bundle_adapts_and_refines_from_its_new_heads(
    mtp_bundle_of, copy_bundle, tmp_path
):
    """The update records the heads' file and hash in the recipe; those name the file, not what
    the heads were trained as, so --adapt and --init still know the heads the bundle carries."""
    from mtp_edge.runtime.adapt import bundle_heads

    bundle = copy_bundle(mtp_bundle_of("none"), "bundle")
    heads = refined_heads(bundle, tmp_path / "refined.safetensors", seed=3)
    assert update(bundle, "--heads", heads).exit_code == 0

    head, source = bundle_heads(open_bundle(bundle), str(heads))
    assert source == str(heads) and head.config.draft_vocab_size == 48
    args = ["--bundle", str(bundle), "--prompt", "the cat sat on", "--no-chat-template"]
    args += ["--json", "-", "--max-new-tokens", "24", "--draft-confidence", "0"]
    adapted = CliRunner().invoke(run, [*args, "--adapt", "--heads", str(heads)])
    assert adapted.exit_code == 0, adapted.output
    plain = CliRunner().invoke(run, [*args, "--drafter", "none"])
    assert json.loads(adapted.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    # Heads other than the ones swapped in are refused, naming the file the bundle carries.
    other = refined_heads(bundle, tmp_path / "other.safetensors", seed=4, draft_tokens=40)
    with pytest.raises(UserError, match=r"it carries refined.safetensors, swapped in with"):
        bundle_heads(open_bundle(bundle), str(other))


def test_update_into_another_directory_leaves_the_bundle(mtp_bundle_of, copy_bundle, tmp_path):
    bundle = copy_bundle(mtp_bundle_of("none"), "bundle")
    listing = {p.name: file_sha(p) for p in bundle.iterdir()}
    heads = refined_heads(bundle, tmp_path / "refined.safetensors", seed=2)

    result = update(bundle, "--heads", heads, "--out", tmp_path / "new")

    assert result.exit_code == 0, result.output
    assert {p.name: file_sha(p) for p in bundle.iterdir()} == listing
    new = Manifest.load(tmp_path / "new")
    assert new.drafter.recipe["heads_sha256"] == sha256(heads)
    assert file_sha(tmp_path / "new" / "target.pte") == listing["target.pte"]


def edit_manifest(bundle: Path, **changes) -> None:
    path = bundle / "manifest.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        section, _, name = key.rpartition("__")
        (data[section] if section else data)[name] = value
    path.write_text(json.dumps(data))


def break_bundle(bundle: Path, heads: Path, how: str, tmp_path: Path) -> tuple[Path, dict]:
    """(heads file, --out arguments) for one way of asking the impossible, from a copy of a
    bundle and the heads it carries."""
    out: dict = {}
    if how == "heads of another model":
        source = Manifest.load(bundle).source["path"]
        other = tmp_path / "other-model"
        shutil.copytree(source, other)
        weights = other / "model.safetensors"
        from safetensors.torch import load_file, save_file

        state = load_file(weights)
        state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * 1.5
        save_file(state, weights)
        heads = save_random_heads(other, tmp_path / "other.safetensors", "none")
    elif how == "heads reading the target's cache":
        heads = save_random_heads(
            Manifest.load(bundle).source["path"], tmp_path / "cache.safetensors", "target_cache"
        )
    elif how == "self heads on onnx":
        heads = save_random_heads(
            Manifest.load(bundle).source["path"], tmp_path / "self.safetensors", "self"
        )
    elif how == "an n-gram bundle":
        edit_manifest(bundle, drafter__kind="ngram")
    elif how == "heads inside the target's program":
        edit_manifest(bundle, drafter__method="draft", drafter__reads_target_cache=True)
    elif how == "a core ml bundle":
        edit_manifest(bundle, platform="coreml", backend="coreml")
    elif how == "a damaged bundle":
        with open(bundle / "drafter.pte", "r+b") as f:
            f.seek(200)
            byte = f.read(1)
            f.seek(200)
            f.write(bytes([byte[0] ^ 1]))
    elif how == "its source checkpoint gone":
        edit_manifest(bundle, source={"path": str(tmp_path / "gone"), "format": "hf"})
    elif how == "no heads file":
        heads = tmp_path / "missing.safetensors"
    elif how == "heads a directory":
        heads = tmp_path / "heads-dir"
        heads.mkdir()
    elif how == "--out a file":
        out = {"--out": tmp_path / "a-file"}
        out["--out"].write_text("not a bundle")
    elif how == "--out a directory that is not a bundle":
        out = {"--out": tmp_path / "a-dir"}
        (out["--out"] / "x").mkdir(parents=True)
    return heads, out


REFUSALS = {
    "heads of another model": "heads were trained for",
    "heads reading the target's cache": "draft method of target.pte",
    "self heads on onnx": "does not run self-attending",
    "an n-gram bundle": "not MTP heads",
    "heads inside the target's program": "mtp-export --target android",
    "a core ml bundle": "mtp-export --target coreml",
    "a damaged bundle": "does not match its sha256",
    "its source checkpoint gone": "is gone",
    "no heads file": "MTP heads not found",
    "heads a directory": "is a directory: give the .safetensors heads file",
    "--out a file": "is a file",
    "--out a directory that is not a bundle": "is not a bundle",
}


@pytest.mark.parametrize("how", REFUSALS)
def test_refused_in_one_line_with_nothing_written(
    how, mtp_bundle_of, onnx_mtp_bundle, copy_bundle, tmp_path
):
    shared = onnx_mtp_bundle if how == "self heads on onnx" else mtp_bundle_of("none")
    bundle = copy_bundle(shared, "bundle")
    heads, out = break_bundle(bundle, shared.parent / "heads.safetensors", how, tmp_path)
    before = {p.relative_to(tmp_path): p.stat().st_mtime_ns for p in tmp_path.rglob("*")}

    result = update(bundle, "--heads", heads, *[str(v) for kv in out.items() for v in kv])

    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert REFUSALS[how] in lines[0]
    assert {p.relative_to(tmp_path): p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before
