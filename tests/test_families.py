"""The family registry: a bundle's manifest `family` picks how it is served and verified; v1 builds through it."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
from servers import free_port

from service.api import __main__ as entry_point
from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.engine.types import SynthesisOptions
from service.errors import BundleError, InvalidInputError, SettingError
from service.families import registry
from service.families.cosyvoice1.contract import FAMILY as FAMILY_V1
from service.families.cosyvoice1.model import CosyVoice1Model
from service.families.cosyvoice2.assembly import stream_schedule
from service.families.cosyvoice2.contract import FAMILY as FAMILY_V2
from service.families.cosyvoice2.voice import Voice2
from service.families.model import Family, ModelContext
from service.runtime import runtime_options
from service.stores.voices import DirectoryVoiceStore, PromptFeatures, SavedVoice


def test_the_registry_knows_both_families_by_their_manifest_names() -> None:
    assert set(registry.FAMILIES) == {FAMILY_V1, FAMILY_V2, "cosyvoice3"}
    assert registry.family(FAMILY_V1).load is not None


def test_an_unknown_family_is_a_bundle_error_naming_the_known_ones() -> None:
    with pytest.raises(BundleError, match=r"'cosyvoice9' is not known.*cosyvoice1, cosyvoice2"):
        registry.family("cosyvoice9")


def test_a_verified_but_unserved_family_is_refused_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    verify_only = Family("cosyvoice9", registry.family(FAMILY_V2).layout, verify=registry.family(FAMILY_V2).verify)
    monkeypatch.setitem(registry.FAMILIES, verify_only.name, verify_only)
    bundle = cast(ModelBundle, SimpleNamespace(family="cosyvoice9", root=Path("models/cv9")))
    with pytest.raises(BundleError, match="'cosyvoice9' cannot be served yet \\(served: cosyvoice1, cosyvoice2, cosyvoice3\\)"):
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


# ---- first_hop_tokens (engine profile): the settings accept >= 1, each family refuses what it cannot honour at start ----------
def serve_from_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> dict[str, Any]:
    """Run `python -m service.api`'s main() with only `env` as TTS_* variables; `serve` records the app it was given
    instead of serving. SystemExit (with the one-line error on stderr) when the entry point refuses to start."""
    served: dict[str, Any] = {}
    monkeypatch.setattr(entry_point, "serve", lambda app, *_: served.update(app=app) or True)
    for key in [k for k in os.environ if k.startswith("TTS_")]:
        monkeypatch.delenv(key)
    for key, value in {"TTS_PORT": str(free_port()), "TTS_GRPC_PORT": "0", **env}.items():
        monkeypatch.setenv(key, value)
    entry_point.main()
    return served


def test_a_v1_server_refuses_a_first_hop_within_its_overlap_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tiny_bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        serve_from_env(monkeypatch, {"TTS_MODEL_DIR": str(tiny_bundle), "TTS_ENGINE_PROFILE": "first_hop_tokens=10"})
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: TTS_ENGINE_PROFILE lever first_hop_tokens: must be at least 21 for CosyVoice-300M "
        "(more than its 20-token overlap), got 10"
    ]
    assert serve_from_env(monkeypatch, {"TTS_MODEL_DIR": str(tiny_bundle), "TTS_ENGINE_PROFILE": "first_hop_tokens=21"})["app"]


def test_the_v1_family_refuses_the_first_hop_when_loaded_without_the_entry_point(tiny_bundle: Path) -> None:
    """create_app, the CLI and benchmarks load through the registry: the family checks there too, before any graph."""
    bundle = ModelBundle.load(tiny_bundle)
    context = ModelContext(options=RuntimeOptions(first_hop_tokens=20), engine_loader=lambda *_: pytest.fail("loaded"))
    with pytest.raises(SettingError, match="at least 21 for CosyVoice-300M") as refused:
        registry.load_model(bundle, context)
    assert refused.value.param == "first_hop_tokens"


def test_a_bundle_that_is_not_there_is_one_line_naming_tts_model_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        serve_from_env(monkeypatch, {"TTS_MODEL_DIR": str(tmp_path)})
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: TTS_MODEL_DIR: {tmp_path}: not a model bundle (manifest.json is missing)"
    ]


def test_an_unknown_default_speaker_is_one_line_before_the_load(
    monkeypatch: pytest.MonkeyPatch, tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo in TTS_DEFAULT_SPEAKER stops the server in one line at once (it was a traceback after the load); a saved
    voice of that name, or a store that cannot be read yet (the load decides then), lets it start."""
    voices = tmp_path / "voices"
    env = {"TTS_MODEL_DIR": str(tiny_bundle), "TTS_VOICES_DIR": str(voices), "TTS_DEFAULT_SPEAKER": "nobody"}
    with pytest.raises(SystemExit) as exited:
        serve_from_env(monkeypatch, env)
    assert exited.value.code == 2
    speakers = ", ".join(ModelBundle.load(tiny_bundle).speakers)
    assert capsys.readouterr().err.splitlines() == [
        f"error: TTS_DEFAULT_SPEAKER: 'nobody' is neither a built-in speaker nor a saved voice; the bundle has {speakers}"
    ]
    g = np.random.default_rng(0)
    features = PromptFeatures(g.standard_normal(192).astype(np.float32), np.arange(75, dtype=np.int32),
                              g.standard_normal((150, 80)).astype(np.float32), 3.0, "trained")  # fmt: skip
    DirectoryVoiceStore(voices).add(SavedVoice("nobody", "", features, "ab" * 32, "models-x"), max_voices=5)
    assert serve_from_env(monkeypatch, env)["app"]
    down = env | {"TTS_VOICES_DIR": str(tmp_path / "empty"), "TTS_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    assert serve_from_env(monkeypatch, down)["app"]


def test_a_v2_server_streams_a_first_chunk_of_6_tokens_set_at_start(
    monkeypatch: pytest.MonkeyPatch, tiny_v2_bundle: Path
) -> None:
    """CosyVoice2 solves any first hop from its caches: 6 is accepted at start and its first chunk holds 6 tokens."""
    served = serve_from_env(monkeypatch, {"TTS_MODEL_DIR": str(tiny_v2_bundle), "TTS_ENGINE_PROFILE": "first_hop_tokens=6"})
    settings = served["app"].state.tts.runtime.settings
    context = ModelContext(options=runtime_options(settings), prompt_analysis=False)
    model = registry.load_model(ModelBundle.load(tiny_v2_bundle), context)
    try:
        ids = [list(s.ids) for s in model.frontend.sentences("收到好友从远方寄来的生日礼物。") if s.ids]
        options = SynthesisOptions(seed=1, stream=True)
        chunks = list(model.synthesize(ids, model.warmup_voice(), options, threading.Event()))
    finally:
        model.close()
    assert len(chunks) > 1 and chunks[-1].is_final  # 2-20 speech tokens per text token: more than 6 + look-ahead
    assert chunks[0].speech_tokens == 6


def test_the_official_v2_schedule_pads_the_first_hop_set_at_start(tiny_v2_bundle: Path) -> None:
    """stream_schedule=official keeps its cut (first hop padded to a 25-token attention chunk) from the set base."""
    bundle = ModelBundle.load(tiny_v2_bundle)
    official = stream_schedule(bundle, RuntimeOptions(stream_schedule="official"))
    assert official.first == 25 and official.first_hop(37) == 38
    schedule = stream_schedule(bundle, RuntimeOptions(stream_schedule="official", first_hop_tokens=6))
    assert schedule.first == 6 and [schedule.first_hop(p) for p in (0, 37)] == [25, 13]
    assert stream_schedule(bundle, RuntimeOptions(first_hop_tokens=6)).first_hop(37) == 6
