"""Manifest capabilities and the prompt group: reading older manifests, and every inconsistency ModelBundle.load refuses."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from service.bundle import MANIFEST_NAME, SPEAKERS_NAME, Capabilities, Manifest, ModelBundle
from service.errors import BundleError
from service.families.cosyvoice1.contract import PROMPT_GRAPH_NAMES
from service.families.registry import open_bundle

Edit = Callable[[dict[str, Any]], None]


def clone(tiny_bundle: Path, dst: Path, edit: Edit | None = None, copies: tuple[str, ...] = ()) -> Path:
    """The committed bundle under `dst`: graphs symlinked (or copied if named in `copies`), manifest edited by `edit`."""
    dst.mkdir()
    for path in tiny_bundle.iterdir():
        if path.name in (MANIFEST_NAME, SPEAKERS_NAME, *copies):
            shutil.copyfile(path, dst / path.name)
        else:
            (dst / path.name).symlink_to(path)
    if edit is not None:
        data = json.loads((dst / MANIFEST_NAME).read_text(encoding="utf-8"))
        edit(data)
        (dst / MANIFEST_NAME).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return dst


def as_old_exporter(data: dict[str, Any]) -> None:
    """What the exporter wrote before capabilities: no capabilities key, no graph groups, no prompt graphs."""
    del data["capabilities"]
    for name in PROMPT_GRAPH_NAMES:
        del data["graphs"][name]
    for graph in data["graphs"].values():
        del graph["group"]


def no_speakers(data: dict[str, Any]) -> None:
    data["capabilities"].update(builtin_speakers=False, instruct=False)


def test_committed_bundle_declares_all_three(tiny_bundle: Path) -> None:
    bundle = ModelBundle.load(tiny_bundle, verify_hashes=True)
    assert bundle.capabilities == Capabilities(builtin_speakers=True, prompt_analysis=True, instruct=True)
    assert bundle.has_prompt_analysis
    assert bundle.prompt_model_path("campplus") == tiny_bundle / "campplus.onnx"
    assert bundle.prompt_model_path("speech_tokenizer") == tiny_bundle / "speech_tokenizer_v1.onnx"
    assert set(bundle.manifest.graphs_in("prompt")) == set(PROMPT_GRAPH_NAMES)


def test_manifest_round_trips(tiny_bundle: Path) -> None:
    manifest = ModelBundle.load(tiny_bundle).manifest
    assert Manifest.from_dict(json.loads(manifest.to_json())) == manifest
    assert manifest.to_json() == (tiny_bundle / MANIFEST_NAME).read_text(encoding="utf-8")


def test_old_manifest_loads_with_derived_capabilities(tiny_bundle: Path, tmp_path: Path) -> None:
    bundle = ModelBundle.load(clone(tiny_bundle, tmp_path / "b", as_old_exporter), verify_hashes=True)
    assert bundle.capabilities == Capabilities(builtin_speakers=True, prompt_analysis=False, instruct=False)
    assert not bundle.has_prompt_analysis and bundle.speakers
    assert all(g.group == "core" for g in bundle.manifest.graphs.values())
    with pytest.raises(BundleError, match="no prompt models"):
        bundle.prompt_model_path("campplus")


def test_prompt_only_bundle_has_an_empty_speaker_table(tiny_bundle: Path, tmp_path: Path) -> None:
    root = clone(tiny_bundle, tmp_path / "b", no_speakers)
    (root / SPEAKERS_NAME).write_text('{"speakers": []}\n', encoding="utf-8")
    bundle = ModelBundle.load(root)
    assert bundle.speakers == {} and bundle.has_prompt_analysis and not bundle.capabilities.builtin_speakers


def test_tampered_prompt_model_fails_hash_check(tiny_bundle: Path, tmp_path: Path) -> None:
    root = clone(tiny_bundle, tmp_path / "b", copies=("campplus.onnx",))
    with (root / "campplus.onnx").open("ab") as f:
        f.write(b"\0")
    ModelBundle.load(root)  # hashes are only checked when asked
    with pytest.raises(BundleError, match=r"sha256 mismatch for campplus\.onnx"):
        ModelBundle.load(root, verify_hashes=True)


def test_missing_prompt_model_file_is_an_incomplete_bundle(tiny_bundle: Path, tmp_path: Path) -> None:
    root = clone(tiny_bundle, tmp_path / "b")
    (root / "speech_tokenizer_v1.onnx").unlink()
    with pytest.raises(BundleError, match=r"missing speech_tokenizer_v1\.onnx"):
        ModelBundle.load(root)


def _drop_tokenizer(d: dict[str, Any]) -> None:
    del d["graphs"]["speech_tokenizer"]


def _rename_input(d: dict[str, Any]) -> None:
    d["graphs"]["campplus"]["inputs"] = ["x"]


def _undeclare(d: dict[str, Any]) -> None:
    d["capabilities"]["prompt_analysis"] = False


def _regroup(d: dict[str, Any]) -> None:
    d["graphs"]["llm_step"]["group"] = "prompt"


def _nothing(d: dict[str, Any]) -> None:
    d["capabilities"] = {"builtin_speakers": False, "prompt_analysis": False}
    _drop_tokenizer(d)
    del d["graphs"]["campplus"]


def _instruct_without_speakers(d: dict[str, Any]) -> None:
    d["capabilities"]["builtin_speakers"] = False


def _unknown(d: dict[str, Any]) -> None:
    d["capabilities"]["voice_design"] = True


def _not_bool(d: dict[str, Any]) -> None:
    d["capabilities"]["instruct"] = "yes"


def _not_a_table(d: dict[str, Any]) -> None:
    d["capabilities"] = ["instruct"]


BAD_MANIFESTS: list[tuple[Edit, str]] = [
    (_drop_tokenizer, "declares prompt_analysis but lists no graph for speech_tokenizer"),
    (_rename_input, r"'campplus' has inputs \['x'\]"),
    (_undeclare, "does not declare prompt_analysis"),
    (_regroup, "manifest graph 'llm_step' is in group 'prompt'"),
    (_nothing, "neither builtin_speakers nor prompt_analysis"),
    (_instruct_without_speakers, "instruct without builtin_speakers"),
    (_unknown, "unknown key"),
    (_not_bool, "'instruct' must be true or false"),
    (_not_a_table, "malformed"),
]


@pytest.mark.parametrize(("edit", "message"), BAD_MANIFESTS, ids=[e.__name__.strip("_") for e, _ in BAD_MANIFESTS])
def test_inconsistent_manifest_is_refused(tiny_bundle: Path, tmp_path: Path, edit: Edit, message: str) -> None:
    """Refused by ModelBundle.load (what every bundle must be) or by its family's layout (registry.open_bundle)."""
    with pytest.raises(BundleError, match=message):
        open_bundle(clone(tiny_bundle, tmp_path / "b", edit))


def test_speaker_table_must_agree_with_builtin_speakers(tiny_bundle: Path, tmp_path: Path) -> None:
    empty = clone(tiny_bundle, tmp_path / "empty")
    (empty / SPEAKERS_NAME).write_text('{"speakers": []}\n', encoding="utf-8")
    with pytest.raises(BundleError, match="lists no speakers but the manifest declares builtin_speakers=true"):
        ModelBundle.load(empty)
    with pytest.raises(BundleError, match=r"lists 7 speaker\(s\) but the manifest declares builtin_speakers=false"):
        ModelBundle.load(clone(tiny_bundle, tmp_path / "full", no_speakers))
