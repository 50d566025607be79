"""The manifest's `family`: every manifest names it, a family's own constants live in the section named like it, a
manifest written before the key reads as the legacy family with the same identity, and the registry refuses a bundle
its family's layout does not describe."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from test_bundle_capabilities import clone

from service.bundle import LEGACY_FAMILY, MANIFEST_NAME, Manifest, ModelBundle, expand_io_names
from service.errors import BundleError
from service.families import registry
from service.families.cosyvoice1.contract import FAMILY as FAMILY_V1
from service.families.cosyvoice2.contract import FAMILY as FAMILY_V2
from service.families.cosyvoice2.contract import CosyVoice2Constants, constants_of


def test_the_v1_manifest_names_its_family_and_keeps_its_identity(tiny_bundle: Path) -> None:
    bundle = ModelBundle.load(tiny_bundle)
    text = (tiny_bundle / MANIFEST_NAME).read_text(encoding="utf-8")
    assert json.loads(text)["family"] == FAMILY_V1 == LEGACY_FAMILY and bundle.manifest.to_json() == text
    without = {k: v for k, v in json.loads(text).items() if k != "family"}
    legacy = json.dumps(without, ensure_ascii=False, indent=2, sort_keys=True) + "\n"
    assert bundle.manifest_sha256 == hashlib.sha256(legacy.encode()).hexdigest()  # cache keys of older bundles hold


def test_a_manifest_without_family_is_the_legacy_family_with_the_same_identity(tiny_bundle: Path, tmp_path: Path) -> None:
    def drop(data: dict[str, Any]) -> None:
        del data["family"]

    old = ModelBundle.load(clone(tiny_bundle, tmp_path / "b", drop))
    new = ModelBundle.load(tiny_bundle)
    assert old.manifest == new.manifest and old.manifest_sha256 == new.manifest_sha256


def test_an_unknown_family_loads_as_a_bundle_and_the_registry_names_the_known_ones(tiny_bundle: Path, tmp_path: Path) -> None:
    def family(data: dict[str, Any]) -> None:
        data["family"] = "fun-cosyvoice3"

    bundle = ModelBundle.load(clone(tiny_bundle, tmp_path / "b", family))
    with pytest.raises(BundleError, match=r"family 'fun-cosyvoice3' is not known \(known: cosyvoice1, cosyvoice2, cosyvoice3\)"):
        registry.load_model(bundle)


def test_a_v2_bundle_needs_its_constants_and_its_graphs(tiny_bundle: Path, tmp_path: Path) -> None:
    def without_constants(data: dict[str, Any]) -> None:
        data["family"] = "cosyvoice2"

    with pytest.raises(BundleError, match="section 'cosyvoice2' is missing"):
        constants_of(ModelBundle.load(clone(tiny_bundle, tmp_path / "a", without_constants)).manifest)

    def v1_graphs_as_v2(data: dict[str, Any]) -> None:
        data["family"] = "cosyvoice2"
        data["cosyvoice2"] = dataclasses.asdict(CosyVoice2Constants())
        data["capabilities"]["instruct"] = False
        for name in ("campplus", "speech_tokenizer"):
            del data["graphs"][name]
        data["capabilities"]["prompt_analysis"] = False

    bundle = ModelBundle.load(clone(tiny_bundle, tmp_path / "b", v1_graphs_as_v2))
    with pytest.raises(BundleError, match="manifest lists no graph for llm_prompt, flow_speaker"):
        registry.family(bundle.family).check_bundle(bundle)


def test_instruct2_needs_prompt_analysis(tiny_bundle: Path, tmp_path: Path) -> None:
    def instruct2(data: dict[str, Any]) -> None:
        data["capabilities"]["instruct2"] = True
        data["capabilities"]["prompt_analysis"] = False
        for name in ("campplus", "speech_tokenizer"):
            del data["graphs"][name]

    with pytest.raises(BundleError, match="instruct2 without prompt_analysis"):
        ModelBundle.load(clone(tiny_bundle, tmp_path / "b", instruct2))


def test_a_family_section_round_trips(tiny_bundle: Path) -> None:
    v1 = ModelBundle.load(tiny_bundle).manifest
    section = dataclasses.asdict(CosyVoice2Constants(encoder_blocks=2))
    v2 = dataclasses.replace(v1, family=FAMILY_V2, family_section=section)
    again = Manifest.from_dict(json.loads(v2.to_json()))
    assert again == v2 and json.loads(v2.to_json())["cosyvoice2"]["encoder_blocks"] == 2
    assert constants_of(again).encoder_blocks == 2


def test_template_names_expand_per_family_count() -> None:
    counts = CosyVoice2Constants(encoder_blocks=2, up_blocks=1, estimator_blocks=3).graph_counts()
    names = expand_io_names(("x", "enc_k_{e}", "up_k_{u}", "past_k_{b}", "k_{i}"), 2, counts)
    assert names == ["x", "enc_k_0", "enc_k_1", "up_k_0", "past_k_0", "past_k_1", "past_k_2", "k_0", "k_1"]
    assert set(registry.FAMILIES) == {FAMILY_V1, FAMILY_V2, "cosyvoice3"}
