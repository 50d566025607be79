"""A bundle on disk: file hashes, speakers, and ModelBundle.load() with its file checks."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.bundle.constants import ModelConstants
from service.bundle.layout import FLOAT_SUFFIX, GROUP_PROMPT, MANIFEST_NAME, NATIVE_SUFFIX, SPEAKERS_NAME
from service.bundle.manifest import Capabilities, Manifest
from service.errors import BundleError


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_speakers(path: Path) -> dict[str, np.ndarray]:
    """Speaker table: name -> raw float32 x-vector of shape (spk_embed_dim,), in file order."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return {s["name"]: np.asarray(s["embedding"], dtype=np.float32) for s in data["speakers"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BundleError(f"{path}: cannot read speaker table: {e}") from e


def write_speakers(path: Path, speakers: dict[str, np.ndarray]) -> None:
    """Write the speaker table as JSON (float32 values round-trip exactly)."""
    rows = [{"name": n, "embedding": [float(x) for x in np.asarray(e, np.float32).reshape(-1)]} for n, e in speakers.items()]
    path.write_text(json.dumps({"speakers": rows}, ensure_ascii=False) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class ModelBundle:
    """A validated bundle on disk: manifest, graph paths, speakers and tokenizer file."""

    root: Path
    manifest: Manifest
    speakers: dict[str, np.ndarray]

    @property
    def constants(self) -> ModelConstants:
        return self.manifest.constants

    @property
    def family(self) -> str:
        return self.manifest.family

    @property
    def manifest_sha256(self) -> str:
        """Identity of the bundle (used in cache keys): the sha256 of its manifest's identity JSON."""
        return hashlib.sha256(self.manifest.identity_json().encode("utf-8")).hexdigest()

    @property
    def capabilities(self) -> Capabilities:
        return self.manifest.capabilities

    @property
    def has_prompt_analysis(self) -> bool:
        """True when the prompt models (campplus, speech_tokenizer) are in the bundle: voices from prompt audio."""
        return self.manifest.capabilities.prompt_analysis

    def graph_path(self, name: str) -> Path:
        return self.root / self.manifest.graphs[name].file

    def float_graph_path(self, name: str) -> Path | None:
        """A floating-point form of core graph `name`: the graph itself when it is fp32, else its float twin (group
        "float"), else None (a quantized graph without a twin)."""
        entry = self.manifest.graphs[name]
        if entry.precision == "fp32":
            return self.graph_path(name)
        twin = name + FLOAT_SUFFIX
        return self.graph_path(twin) if twin in self.manifest.graphs else None

    def native_graph_path(self, name: str) -> Path | None:
        """The native twin of core graph `name` (group "native": some of its nodes as our kernels), or None when the
        bundle has none."""
        twin = name + NATIVE_SUFFIX
        return self.graph_path(twin) if twin in self.manifest.graphs else None

    def prompt_model_path(self, name: str) -> Path:
        """Path of a prompt model ("campplus" or "speech_tokenizer"); BundleError if the bundle has none."""
        if not self.has_prompt_analysis:
            raise BundleError(f"{self.root}: the bundle has no prompt models (exported without them)")
        entry = self.manifest.graphs.get(name)
        if entry is None or entry.group != GROUP_PROMPT:
            known = ", ".join(self.manifest.graphs_in(GROUP_PROMPT))
            raise BundleError(f"unknown prompt model {name!r} (known: {known})")
        return self.graph_path(name)

    def file(self, name: str) -> Path:
        """Path of a non-graph file the manifest lists (tokenizer, speakers, a noise buffer); BundleError otherwise."""
        if name not in self.manifest.files:
            raise BundleError(f"{self.root}: the manifest lists no file {name!r}")
        return self.root / name

    @classmethod
    def load(cls, path: str | Path, *, verify_hashes: bool = False) -> ModelBundle:
        """Read and validate a bundle directory; raises BundleError with one clear message."""
        root = Path(path)
        mpath = root / MANIFEST_NAME
        if not root.is_dir():
            raise BundleError(f"{root}: not a directory (expected a model bundle)")
        if not mpath.is_file():
            raise BundleError(f"{root}: not a model bundle ({MANIFEST_NAME} is missing)")
        try:
            data = json.loads(mpath.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise BundleError(f"{mpath}: cannot parse: {e}") from e
        manifest = Manifest.from_dict(data)
        _check_files(root, manifest, verify_hashes)
        speakers = _checked_speakers(root / SPEAKERS_NAME, manifest)
        return cls(root=root, manifest=manifest, speakers=speakers)


def _checked_speakers(path: Path, manifest: Manifest) -> dict[str, np.ndarray]:
    """The speaker table, which must agree with capabilities.builtin_speakers (empty exactly when it is false)."""
    speakers = read_speakers(path)
    dim = manifest.constants.spk_embed_dim
    bad = [n for n, e in speakers.items() if e.shape != (dim,)]
    if bad:
        raise BundleError(f"{path}: expected speakers with {dim}-d embeddings, bad: {bad}")
    declared = manifest.capabilities.builtin_speakers
    if declared != bool(speakers):
        listed = f"lists {len(speakers)} speaker(s)" if speakers else "lists no speakers"
        raise BundleError(f"{path}: {listed} but the manifest declares builtin_speakers={str(declared).lower()}")
    return speakers


def _check_files(root: Path, manifest: Manifest, verify_hashes: bool) -> None:
    """Every listed file (graphs of every group, speakers, tokenizer, ...) present, and hashed when asked."""
    expected = {g.file: g.sha256 for g in manifest.graphs.values()} | manifest.files
    expected |= {g.weights: g.weights_sha256 for g in manifest.graphs.values() if g.weights}
    expected.setdefault(SPEAKERS_NAME, "")
    missing = sorted(f for f in expected if not (root / f).is_file())
    if missing:
        raise BundleError(f"{root}: bundle is incomplete, missing {', '.join(missing)}")
    if verify_hashes:
        bad = sorted(f for f, h in expected.items() if h and sha256_file(root / f) != h)
        if bad:
            raise BundleError(f"{root}: sha256 mismatch for {', '.join(bad)}")
