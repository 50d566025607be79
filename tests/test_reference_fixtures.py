"""The reference fixtures (tests/reference) are intact; the vendored v1 set is identical to the shared folder when it exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REFERENCE, REPO, TINY_COSYVOICE2_REF, TINY_COSYVOICE3_REF, TINY_REF

from service.bundle import sha256_file

SHARED_REFERENCE = REPO.parent / "shared" / "reference"
# Written here, not copied: the note on where the fixtures come from, and the CosyVoice2 and CosyVoice3 sets, which the
# scripts in scripts/ generate in this repository (tests/reference/README.md).
OWN_FILES = {"README.md", "cosyvoice2-0.5b.shapes.json", "fun-cosyvoice3-0.5b.shapes.json"}
OWN_FOLDERS = ("tiny-cosyvoice2/", "tiny-cosyvoice3/")
TABLE_ROW = re.compile(r"^\| (\S+) \| (\d+) \| `([0-9a-f]{64})` \|$", re.M)


sha256 = sha256_file  # the bundle's own reader: one implementation of "hash a file"


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def vendored_files() -> set[str]:
    return {name for name in files_under(REFERENCE) - OWN_FILES if not name.startswith(OWN_FOLDERS)}


def readme_table(readme: Path) -> dict[str, tuple[int, str]]:
    return {name: (int(size), digest) for name, size, digest in TABLE_ROW.findall(readme.read_text("utf-8"))}


@pytest.mark.parametrize("folder", [TINY_REF, TINY_COSYVOICE2_REF, TINY_COSYVOICE3_REF], ids=lambda p: p.name)
def test_files_match_the_sha256_table_of_their_readme(folder: Path) -> None:
    table = readme_table(folder / "README.md")
    assert len(table) >= 15, f"the file table of {folder}/README.md was not found"
    assert files_under(folder) == set(table) | {"README.md"}, "files missing from, or not listed in, the README table"
    for name, (size, digest) in sorted(table.items()):
        path = folder / name
        assert (path.stat().st_size, sha256(path)) == (size, digest), f"{name} differs from its README entry"


def test_generated_files_outside_the_folders_match_the_reference_readme() -> None:
    table = readme_table(REFERENCE / "README.md")
    assert set(table) == OWN_FILES - {"README.md"}, "tests/reference/README.md must list the generated top-level files"
    for name, (size, digest) in table.items():
        path = REFERENCE / name
        assert (path.stat().st_size, sha256(path)) == (size, digest), (
            f"{name} differs from its entry in tests/reference/README.md"
        )


@pytest.mark.skipif(not SHARED_REFERENCE.is_dir(), reason=f"no shared reference folder at {SHARED_REFERENCE} to compare with")
def test_vendored_files_are_byte_identical_to_the_shared_reference() -> None:
    vendored = vendored_files()
    vendored_tiny = {name.removeprefix("tiny/") for name in vendored if name.startswith("tiny/")}
    missing = files_under(SHARED_REFERENCE / "tiny") - vendored_tiny
    assert not missing, f"new files in {SHARED_REFERENCE / 'tiny'} are not vendored: {sorted(missing)}"
    for name in sorted(vendored):
        shared = SHARED_REFERENCE / name
        assert shared.is_file(), f"tests/reference/{name} has no counterpart in {SHARED_REFERENCE}"
        assert sha256(REFERENCE / name) == sha256(shared), f"tests/reference/{name} differs from {shared}: refresh the copy"
