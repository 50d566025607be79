"""Byte-reproducible fixture files (npz with fixed zip timestamps, sorted JSON) and the README's generated tables."""

from __future__ import annotations

import hashlib
import io
import json
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

EPOCH = (1980, 1, 1, 0, 0, 0)
GENERATED = re.compile(r"(<!-- generated:(\w+) -->\n).*?(<!-- /generated:\2 -->)", re.S)


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez_compressed, but with fixed member timestamps so that equal arrays give equal bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name in sorted(arrays):
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, buffer.getvalue())


def save_json(path: Path, payload: Any) -> None:
    path.write_text(json.dumps(payload, indent=1, ensure_ascii=False, default=_plain) + "\n", encoding="utf-8")


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def file_table(root: Path) -> str:
    """Markdown rows `| path | bytes | sha256 |` for every file under `root` except README.md."""
    rows = ["| file | bytes | sha256 |", "|---|---|---|"]
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != "README.md"):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        rows.append(f"| {path.relative_to(root).as_posix()} | {path.stat().st_size} | `{digest}` |")
    return "\n".join(rows)


def array_table(path: Path, describe: Any) -> str:
    """Markdown rows `| array | shape | dtype | meaning |` for an npz file (meaning from `describe(name)`)."""
    rows = ["| array | shape | dtype | meaning |", "|---|---|---|---|"]
    with np.load(path) as data:
        for name in sorted(data.files):
            value = data[name]
            rows.append(f"| `{name}` | {list(value.shape)} | {value.dtype} | {describe(name)} |")
    return "\n".join(rows)


def fill_generated(readme: Path, blocks: dict[str, str]) -> None:
    """Replace each `<!-- generated:NAME -->...<!-- /generated:NAME -->` block of `readme` with blocks[NAME]."""
    text = readme.read_text(encoding="utf-8")
    missing = set(blocks) - {m.group(2) for m in GENERATED.finditer(text)}
    if missing:
        raise ValueError(f"{readme}: no generated block for {sorted(missing)}")
    text = GENERATED.sub(
        lambda m: m.group(1) + blocks[m.group(2)] + "\n" + m.group(3) if m.group(2) in blocks else m.group(0), text
    )
    readme.write_text(text, encoding="utf-8")
