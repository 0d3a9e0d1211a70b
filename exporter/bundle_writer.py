"""Writing bundles so that an interrupted export leaves nothing half-written under its name.

Everything is written into a temporary sibling directory, hashed into the manifest, then renamed
into place (mtp_edge.files.atomic_directory); on any failure (Ctrl-C included) the temporary
directory is removed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mtp_edge.errors import UserError
from mtp_edge.files import atomic_directory, check_output, remove_stale_partials
from mtp_edge.manifest import Manifest, sha256


def check_writable(out: Path) -> None:
    """Fail before hours of work, not after: `--out` must be creatable where it is, and not
    something else than a bundle. Temporary directories that dead exports to the same `--out`
    left (killed without a chance to clean up) are removed."""
    check_output(out, "--out", directory=True)
    if out.exists() and not (out / "manifest.json").exists():
        raise UserError(f"--out {out} exists and is not a bundle: choose another path")
    remove_stale_partials(out)


def write_bundle(
    out: Path,
    build: Callable[[Path], Manifest],
    finish: Callable[[Path, Manifest], None] | None = None,
) -> Manifest:
    """Run `build(tmp_dir)`, which writes the files and returns their manifest, then publish.

    `finish(tmp_dir, manifest)` runs on the complete bundle before it is published (e.g. to
    measure it through the runtime) and may add to the manifest, which is then saved again.
    The caller checked `out` with check_writable before its slow part.
    """
    out = Path(out)
    with atomic_directory(out) as tmp:
        manifest = build(tmp)
        for entry in manifest.models.values():
            entry.sha256 = sha256(tmp / entry.file)
        manifest.save(tmp)
        if finish is not None:
            finish(tmp, manifest)
            manifest.save(tmp)
    return manifest
