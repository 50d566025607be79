"""The family registry: a bundle's manifest `family` picks how it is served and verified; v1 builds through it."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest

from service.bundle import FAMILY_V1, FAMILY_V2, ModelBundle
from service.engine.synthesizer import SynthesisOptions
from service.errors import BundleError, InvalidInputError
from service.families import registry
from service.families.cosyvoice1.model import CosyVoice1Model
from service.families.cosyvoice2.voice import Voice2
from service.families.model import Family, ModelContext


def test_the_registry_knows_both_families_by_their_manifest_names() -> None:
    assert set(registry.FAMILIES) == {FAMILY_V1, FAMILY_V2}
    assert registry.family(FAMILY_V1).load is not None


def test_an_unknown_family_is_a_bundle_error_naming_the_known_ones() -> None:
    with pytest.raises(BundleError, match=r"'cosyvoice9' is not known.*cosyvoice1, cosyvoice2"):
        registry.family("cosyvoice9")


def test_a_verified_but_unserved_family_is_refused_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    verify_only = Family("cosyvoice9", verify=registry.family(FAMILY_V2).verify)
    monkeypatch.setitem(registry.FAMILIES, verify_only.name, verify_only)
    bundle = cast(ModelBundle, SimpleNamespace(family="cosyvoice9", root=Path("models/cv9")))
    with pytest.raises(BundleError, match="'cosyvoice9' cannot be served yet \\(served: cosyvoice1, cosyvoice2\\)"):
        registry.load_model(bundle)


def test_both_families_are_served() -> None:
    assert all(registry.family(name).load is not None for name in (FAMILY_V1, FAMILY_V2))


def test_a_v1_bundle_loads_as_the_cosyvoice1_model_and_speaks(tiny_bundle: Path) -> None:
    bundle = ModelBundle.load(tiny_bundle)
    model = registry.load_model(bundle, ModelContext(prompt_analysis=False))
    try:
        assert isinstance(model, CosyVoice1Model)
        assert (model.family, model.model_id, model.capabilities) == (FAMILY_V1, bundle.manifest.model, bundle.capabilities)
        assert list(model.speakers) == list(bundle.speakers) and not model.voices.can_clone
        ids = [list(s.ids) for s in model.frontend.sentences("你好。") if s.ids]
        voice = model.voice(model.speakers[0])
        chunks = list(model.synthesize(ids, voice, SynthesisOptions(seed=1), threading.Event()))
        assert chunks and chunks[-1].is_final and all(c.sample_rate == model.sample_rate for c in chunks)
        stranger = Voice2.builtin("other", np.zeros(192, np.float32))
        with pytest.raises(InvalidInputError, match="another model family"):
            model.synthesize(ids, stranger, SynthesisOptions(seed=1), threading.Event())
    finally:
        model.close()
