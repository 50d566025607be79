"""The manifest's `family`: v1 manifests read and write as before, unknown families and inconsistent v2 keys are refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from test_bundle_capabilities import clone

from service.bundle import (
    FAMILIES,
    FAMILY_V1,
    FAMILY_V2,
    MANIFEST_NAME,
    CosyVoice2Constants,
    Manifest,
    ModelBundle,
    expand_io_names,
)
from service.errors import BundleError


def test_v1_manifest_has_no_family_key_and_keeps_its_bytes(tiny_bundle: Path) -> None:
    bundle = ModelBundle.load(tiny_bundle)
    text = (tiny_bundle / MANIFEST_NAME).read_text(encoding="utf-8")
    assert bundle.family == FAMILY_V1 and bundle.manifest.cosyvoice2 is None
    assert "family" not in json.loads(text) and "instruct2" not in json.loads(text)["capabilities"]
    assert bundle.manifest.to_json() == text


def test_explicit_v1_family_reads_the_same(tiny_bundle: Path, tmp_path: Path) -> None:
    def family(data: dict[str, Any]) -> None:
        data["family"] = "cosyvoice1"

    assert ModelBundle.load(clone(tiny_bundle, tmp_path / "b", family)).manifest == ModelBundle.load(tiny_bundle).manifest


def test_unknown_family_names_the_known_ones(tiny_bundle: Path, tmp_path: Path) -> None:
    def family(data: dict[str, Any]) -> None:
        data["family"] = "fun-cosyvoice3"

    with pytest.raises(BundleError, match=r"family 'fun-cosyvoice3' is not known \(known: cosyvoice1, cosyvoice2\)"):
        ModelBundle.load(clone(tiny_bundle, tmp_path / "b", family))


def test_v2_family_needs_its_constants_and_its_graphs(tiny_bundle: Path, tmp_path: Path) -> None:
    def without_constants(data: dict[str, Any]) -> None:
        data["family"] = "cosyvoice2"

    with pytest.raises(BundleError, match="'cosyvoice2' must be present exactly when family is 'cosyvoice2'"):
        ModelBundle.load(clone(tiny_bundle, tmp_path / "a", without_constants))

    def v1_graphs_as_v2(data: dict[str, Any]) -> None:
        data["family"] = "cosyvoice2"
        data["cosyvoice2"] = dataclasses.asdict(CosyVoice2Constants())
        data["capabilities"]["instruct"] = False
        data["capabilities"]["builtin_speakers"] = True
        for name in ("campplus", "speech_tokenizer"):
            del data["graphs"][name]
        data["capabilities"]["prompt_analysis"] = False

    with pytest.raises(BundleError, match="manifest lists no graph for llm_prompt, flow_speaker"):
        ModelBundle.load(clone(tiny_bundle, tmp_path / "b", v1_graphs_as_v2))


def test_instruct2_needs_prompt_analysis(tiny_bundle: Path, tmp_path: Path) -> None:
    def instruct2(data: dict[str, Any]) -> None:
        data["capabilities"]["instruct2"] = True
        data["capabilities"]["prompt_analysis"] = False
        for name in ("campplus", "speech_tokenizer"):
            del data["graphs"][name]

    with pytest.raises(BundleError, match="instruct2 without prompt_analysis"):
        ModelBundle.load(clone(tiny_bundle, tmp_path / "b", instruct2))


def test_v2_manifest_round_trips(tiny_bundle: Path) -> None:
    v1 = ModelBundle.load(tiny_bundle).manifest
    v2 = dataclasses.replace(v1, family=FAMILY_V2, cosyvoice2=CosyVoice2Constants(encoder_blocks=2))
    again = Manifest.from_dict(json.loads(v2.to_json()))
    assert again == v2 and json.loads(v2.to_json())["cosyvoice2"]["encoder_blocks"] == 2


def test_template_names_expand_per_family_count() -> None:
    counts = CosyVoice2Constants(encoder_blocks=2, up_blocks=1, estimator_blocks=3).graph_counts()
    names = expand_io_names(("x", "enc_k_{e}", "up_k_{u}", "past_k_{b}", "k_{i}"), 2, counts)
    assert names == ["x", "enc_k_0", "enc_k_1", "up_k_0", "past_k_0", "past_k_1", "past_k_2", "k_0", "k_1"]
    assert set(FAMILIES) == {FAMILY_V1, FAMILY_V2}
