"""A third model family, written here and registered only in this test, loads and speaks through the registry and the
HTTP app: the kit, the shared layers and the family scaffolding (LoadedModel, PromptVoices) are all it needs, and no
file outside this one changes. Its "flow" is a fixed table from speech token to mel frame (it has none of its own):
the Qwen2 LLM, the BPE tokenizer and the 24 kHz HiFT vocoder are the shared layers, over the tiny CosyVoice2 graphs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.api import create_app
from service.bundle import SPEAKERS_NAME, FamilyLayout, ModelBundle, sha256_file, write_speakers
from service.engine.sessions import open_sessions
from service.engine.types import AudioChunk, LLMPrompt, StageTimings, SynthesisOptions
from service.errors import InvalidInputError, UnsupportedCapabilityError
from service.families import registry
from service.families.loaded import LoadedModel
from service.families.model import Family, ModelContext, ModelVoice, NamedVoice
from service.families.voices import PromptVoices
from service.frontend import TextFrontend
from service.layers.hift import HiFTRunner
from service.layers.qwen2 import Qwen2Runner
from service.layers.qwen_tokenizer import Qwen2Tokenizer
from service.layers.vocoder import Vocoder, VocoderStream
from service.settings import Settings
from service.stores.analysis_cache import AnalysisCache
from service.stores.voices import MemoryVoiceStore, PromptFeatures
from service.verify.checks import VerifyReport

NAME, TOKENIZER = "toy-qwen-hift", "tokenizer.json"
HIFT = {"hift_f0": (("mel",), ("f0",)), "hift_source": (("sine",), ("source",)), "hift_decode": (("mel", "s_stft"), ("x",))}
LLM = {"llm_prompt": (("text_ids",), ("x",)), "llm_embed": (("token",), ("x",))}
STEP = {"llm_step": (("x", "past_len", "past_k_{i}", "past_v_{i}"), ("logp", "new_k", "new_v"))}
LAYOUT = FamilyLayout(NAME, {**LLM, **STEP, **HIFT}, {}, TOKENIZER, (SPEAKERS_NAME,))


@dataclass(frozen=True)
class ToyVoice:
    name: str
    fingerprint: str
    llm: LLMPrompt


class ToyEngine:
    """Qwen2 LLM -> one table row per token, two frames a token -> the 24 kHz vocoder; one chunk per sentence."""

    def __init__(self, bundle: ModelBundle) -> None:
        sessions = open_sessions(bundle, names=tuple(LAYOUT.graph_io))
        self.llm = Qwen2Runner(sessions, bundle.constants, text_vocab_size=151936)
        self.vocoder = Vocoder(HiFTRunner(sessions, bundle.constants))
        self.table = np.random.default_rng(0).standard_normal((bundle.constants.speech_token_size, 80)).astype(np.float32)
        self.sample_rate = bundle.constants.sample_rate

    def synthesize(
        self, sentences: Sequence[Sequence[int]], voice: ToyVoice, options: SynthesisOptions, cancel: threading.Event | None
    ) -> Iterator[AudioChunk]:
        rng = np.random.default_rng(options.seed)
        for i, ids in enumerate(sentences):
            tokens = list(self.llm.generate(ids, voice.llm, rng, min_tokens=10, max_tokens=10, cancel=cancel))
            mel = np.repeat(self.table[tokens].T, 2, axis=1)
            audio = VocoderStream(self.vocoder, rng).push(mel, final=True)
            last = i == len(sentences) - 1
            yield AudioChunk(audio, i, last, StageTimings(0.0, 0.0, 0.0), True, self.sample_rate, len(tokens))


class ToyVoices(PromptVoices[ToyVoice]):
    """Built-in speakers only: no prompt models, no instructions."""

    can_instruct = False

    def _features(self, audio: np.ndarray, sample_rate: int) -> PromptFeatures:
        raise UnsupportedCapabilityError("the toy family clones no voices")

    def _voice(self, name: str, features: PromptFeatures, transcript_ids: tuple[int, ...]) -> ToyVoice:
        raise UnsupportedCapabilityError("the toy family clones no voices")

    def instruct_voice(self, base: ModelVoice, instruct_text: str) -> ToyVoice:
        raise UnsupportedCapabilityError("the toy family takes no instructions")


class ToyModel(LoadedModel[ToyVoice]):
    family = NAME

    def builtin_voice(self, name: str, embedding: object) -> ToyVoice:
        return ToyVoice(name, hashlib.sha256(np.asarray(embedding).tobytes()).hexdigest()[:32], LLMPrompt(None))

    def own(self, voice: ModelVoice) -> ToyVoice:
        if not isinstance(voice, ToyVoice):
            raise InvalidInputError("not a voice of the toy family", param="voice")
        return voice


def load_toy(bundle: ModelBundle, context: ModelContext) -> ToyModel:
    frontend = TextFrontend.load(Qwen2Tokenizer.load(bundle.file(TOKENIZER)))
    store, cache = context.voice_store or MemoryVoiceStore(), context.analysis_cache or AnalysisCache(None)
    voices = ToyVoices(bundle, frontend, tuple(bundle.speakers), store, cache, can_analyze=False, variant=NAME)
    return ToyModel(bundle, frontend, ToyEngine(bundle), voices)


TOY = Family(NAME, LAYOUT, verify=lambda *_: VerifyReport(skipped=["the toy family has no reference fixtures"]), load=load_toy)


@pytest.fixture()
def toy_bundle(tiny_v2_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A bundle of the toy family made of the tiny CosyVoice2 bundle's LLM and HiFT graphs, with one speaker."""
    monkeypatch.setitem(registry.FAMILIES, NAME, TOY)
    root = tmp_path / "toy"
    root.mkdir()
    manifest = ModelBundle.load(tiny_v2_bundle).manifest
    graphs = {n: g for n, g in manifest.graphs.items() if n in LAYOUT.graph_io}
    for entry in graphs.values():
        shutil.copy(tiny_v2_bundle / entry.file, root / entry.file)
    shutil.copy(tiny_v2_bundle / TOKENIZER, root / TOKENIZER)
    write_speakers(root / SPEAKERS_NAME, {"toy": np.ones(manifest.constants.spk_embed_dim, np.float32)})
    files = {f: sha256_file(root / f) for f in (TOKENIZER, SPEAKERS_NAME)}
    caps = dataclasses.replace(manifest.capabilities, builtin_speakers=True, prompt_analysis=False, instruct2=False)
    toy = dataclasses.replace(
        manifest, model=f"{NAME}-tiny", family=NAME, family_section={}, graphs=graphs, files=files, capabilities=caps
    )
    (root / "manifest.json").write_text(toy.to_json(), encoding="utf-8")
    return root


def test_a_third_family_loads_and_speaks_through_the_registry(toy_bundle: Path) -> None:
    model = registry.load_model(registry.open_bundle(toy_bundle))
    try:
        ids = [list(s.ids) for s in model.frontend.sentences("你好。今天天气很好。") if s.ids]
        chunks = list(model.synthesize(ids, model.resolve(NamedVoice("toy")), SynthesisOptions(seed=3), threading.Event()))
        assert [c.sentence_index for c in chunks] == list(range(len(ids))) and chunks[-1].is_final
        assert all(c.sample_rate == 24000 and c.speech_tokens == 10 and c.audio.size > 0 for c in chunks)
    finally:
        model.close()


def test_the_http_app_serves_the_third_family_unchanged(toy_bundle: Path, tmp_path: Path) -> None:
    settings = Settings(_env_file=None, model_dir=toy_bundle, voices_dir=tmp_path / "v", default_speaker="toy")  # type: ignore[call-arg]
    with TestClient(create_app(settings)) as client:
        info = client.get("/info").json()
        assert info["model"] == f"{NAME}-tiny" and "toy" in json.dumps(info)
        resp = client.post("/tts", json={"text": "你好。", "speaker": "toy", "format": "wav", "seed": 1})
        assert resp.status_code == 200 and resp.content[:4] == b"RIFF"
        refused = client.post("/tts", json={"text": "你好。", "speaker": "nobody"})
        assert refused.status_code == 400
