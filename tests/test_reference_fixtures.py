"""The vendored reference fixtures (tests/reference) are intact and, where the shared folder exists, identical to it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REFERENCE, REPO, TINY_REF

from service.bundle import sha256_file

SHARED_REFERENCE = REPO.parent / "shared" / "reference"
# Written here, not copied: the note on where the fixtures come from.
OWN_FILES = {"README.md"}
TABLE_ROW = re.compile(r"^\| (\S+) \| (\d+) \| `([0-9a-f]{64})` \|$", re.M)


sha256 = sha256_file  # the bundle's own reader: one implementation of "hash a file"


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def vendored_files() -> set[str]:
    return files_under(REFERENCE) - OWN_FILES


def test_tiny_files_match_the_sha256_table_of_their_readme() -> None:
    table = {name: (int(size), digest) for name, size, digest in TABLE_ROW.findall((TINY_REF / "README.md").read_text("utf-8"))}
    assert len(table) >= 20, "the file table of tests/reference/tiny/README.md was not found"
    assert files_under(TINY_REF) == set(table) | {"README.md"}, "files missing from, or not listed in, the README table"
    for name, (size, digest) in sorted(table.items()):
        path = TINY_REF / name
        assert (path.stat().st_size, sha256(path)) == (size, digest), f"{name} differs from its README entry"


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
