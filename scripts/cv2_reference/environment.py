"""The official side: pinned checkout check, import paths, and the two offline stand-ins (torchaudio, wetext rules)."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PINNED_COMMIT = "ace7c47f41bbd303aa6bf1ea80e6f9fbd595cd40"
# git tree object of `cosyvoice/` at PINNED_COMMIT: an unpacked archive (no .git) is checked against it.
PINNED_COSYVOICE_TREE = "8492b2be2ef486253fa9e4841556ed930d5a8515"
MATCHA_SUBMODULE_COMMIT = "dd9105b34bf2be2230f4aa1e4769fb586a3c824e"
IGNORED_NAMES = {"__pycache__", ".DS_Store"}
# wetext==0.0.4 reads <repo>/<lang>/tn/{tagger,verbalizer}.fst from a modelscope snapshot; these are the same rule
# files as shipped in the WeTextProcessing==1.2.0 wheel (what the v1 fixtures used).
WETEXT_RULES = {
    "zh/tn/tagger.fst": "tn/zh_tn_tagger.fst",
    "zh/tn/verbalizer.fst": "tn/zh_tn_verbalizer.fst",
    "en/tn/tagger.fst": "tn/en_tn_tagger.fst",
    "en/tn/verbalizer.fst": "tn/en_tn_verbalizer.fst",
}


class OfficialCheckoutError(RuntimeError):
    """The given directory is not the official CosyVoice code at the pinned commit."""


def git_object_id(kind: str, payload: bytes) -> bytes:
    return hashlib.sha1(f"{kind} {len(payload)}\0".encode() + payload, usedforsecurity=False).digest()


def git_tree_id(directory: Path) -> str:
    """The git tree id of `directory` as it is on disk (regular files as 100644/100755; caches ignored)."""
    return _tree_digest(directory).hex()


def _tree_digest(directory: Path) -> bytes:
    entries: list[tuple[bytes, bytes, bytes]] = []
    for path in directory.iterdir():
        if path.name in IGNORED_NAMES or path.suffix == ".pyc":
            continue
        if path.is_dir():
            entries.append((path.name.encode() + b"/", b"40000", _tree_digest(path)))
        else:
            mode = b"100755" if path.stat().st_mode & 0o111 else b"100644"
            entries.append((path.name.encode(), mode, git_object_id("blob", path.read_bytes())))
    payload = b"".join(mode + b" " + name.rstrip(b"/") + b"\0" + digest for name, mode, digest in sorted(entries))
    return git_object_id("tree", payload)


def check_official_checkout(root: Path) -> str:
    """Raise unless `root` holds the official code at PINNED_COMMIT; return how that was established."""
    if not (root / "cosyvoice" / "cli" / "model.py").is_file():
        raise OfficialCheckoutError(f"{root} is not a CosyVoice checkout (no cosyvoice/cli/model.py)")
    if (root / ".git").exists():
        head = _git(root, "rev-parse", "HEAD")
        if head != PINNED_COMMIT:
            raise OfficialCheckoutError(f"{root} is at {head}, not the pinned commit {PINNED_COMMIT}")
        if _git(root, "status", "--porcelain", "--untracked-files=no", "--", "cosyvoice"):
            raise OfficialCheckoutError(f"{root}/cosyvoice has local changes: the fixtures need the official code unchanged")
        return f"git checkout at {PINNED_COMMIT}, cosyvoice/ unchanged"
    tree = git_tree_id(root / "cosyvoice")
    if tree != PINNED_COSYVOICE_TREE:
        raise OfficialCheckoutError(f"{root}/cosyvoice is tree {tree}, not {PINNED_COSYVOICE_TREE} (commit {PINNED_COMMIT})")
    return f"unpacked tree: cosyvoice/ is git tree {PINNED_COSYVOICE_TREE} of commit {PINNED_COMMIT}"


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


def add_official_paths(root: Path) -> str:
    """Put the official package (and its Matcha-TTS submodule when present) on sys.path; return where matcha comes from."""
    sys.dont_write_bytecode = True  # keep the checkout byte-identical to the pinned tree
    sys.path.insert(0, str(root))
    submodule = root / "third_party" / "Matcha-TTS"
    if (submodule / "matcha").is_dir():
        sys.path.insert(1, str(submodule))
        return f"third_party/Matcha-TTS submodule ({submodule})"
    spec = importlib.util.find_spec("matcha")
    if spec is None:
        raise OfficialCheckoutError("matcha is not importable: clone with --recursive or pip install matcha-tts==0.0.7.2")
    from importlib.metadata import version

    return f"matcha-tts=={version('matcha-tts')} ({spec.origin})"


def install_torchaudio(wheel: Path | None) -> str:
    """Import torchaudio, or assemble it from the pure-Python modules of a torchaudio wheel.

    The wheel's own `_extension` finds no compiled library inside the zip and reports the extension as unavailable;
    only the package `__init__` (which would import torchcodec for `load`) is replaced, by `compliance`,
    `functional`, `transforms` and a soundfile `load`.
    """
    if wheel is None:
        import torchaudio

        return f"torchaudio {torchaudio.__version__} (installed)"
    location = f"{wheel}/torchaudio"  # zipimport reads the .py files straight from the wheel
    package = importlib.util.module_from_spec(importlib.machinery.ModuleSpec("torchaudio", None, is_package=True))
    package.__spec__.submodule_search_locations = [location]  # type: ignore[union-attr]
    package.__path__ = [location]
    sys.modules["torchaudio"] = package
    for name in ("compliance", "functional", "transforms"):
        setattr(package, name, importlib.import_module(f"torchaudio.{name}"))
    package.load = _soundfile_load  # type: ignore[attr-defined]
    package.__version__ = wheel.name.split("-")[1]  # type: ignore[attr-defined]
    return f"torchaudio {package.__version__} pure-Python modules from {wheel.name}; load() = soundfile (see README)"


def _soundfile_load(path: object, backend: str | None = None) -> tuple[object, int]:
    """torchaudio.load(path, backend='soundfile') for PCM WAV: float32 [channels, samples] in [-1, 1)."""
    import soundfile
    import torch

    if isinstance(path, torch.Tensor):
        raise TypeError("torchaudio.load got a torch.Tensor, expected a path or a file-like object")
    data, rate = soundfile.read(path, dtype="float32", always_2d=True)
    return torch.from_numpy(data.T.copy()), rate


def install_wetext_rules(wheel: Path) -> Path:
    """Point wetext==0.0.4's modelscope download at the tn rule files of a WeTextProcessing wheel, unpacked once."""
    target = Path(tempfile.mkdtemp(prefix="wetext-rules-"))
    with zipfile.ZipFile(wheel) as archive:
        for dest, member in WETEXT_RULES.items():
            (target / dest).parent.mkdir(parents=True, exist_ok=True)
            (target / dest).write_bytes(archive.read(member))
    import wetext.wetext

    wetext.wetext.snapshot_download = lambda *args, **kwargs: str(target)
    return target
