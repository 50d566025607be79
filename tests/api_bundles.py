"""Test bundles for the API tests: a copy of the tiny bundle whose manifest says more about itself."""

from __future__ import annotations

import json
from pathlib import Path


def flagged_bundle(src: Path, dst: Path, **manifest_keys: object) -> Path:
    """`dst` as a copy of bundle `src` with `manifest_keys` set in its manifest.json.

    The graphs, speakers and tokenizer are symlinks (their sha256 entries stay valid); the manifest itself is not
    hashed by the bundle, so editing it keeps the bundle loadable (its sha256 changes, so does the cache key).
    """
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.name != "manifest.json":
            (dst / path.name).symlink_to(path.resolve())
    manifest = json.loads((src / "manifest.json").read_text(encoding="utf-8"))
    manifest.update(manifest_keys)
    (dst / "manifest.json").write_text(json.dumps(manifest, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return dst
