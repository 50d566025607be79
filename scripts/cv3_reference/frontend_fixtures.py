"""Prompt analysis (as CosyVoice2's, with speech_tokenizer_v3.onnx) and the CosyVoice3 text and tokenizer fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from cv2_reference.cases import PROMPTS
from cv2_reference.frontend_fixtures import _prompt_meta, _session_recorder, describe_tokenizer, fsq_margin
from cv2_reference.recorder import to_numpy, wrapped

from cv3_reference.cases import TOKENIZER_TEXTS

TOKENIZER_FILE = "speech_tokenizer_v3.onnx"
END_OF_PROMPT_ID = 151646  # the id CosyVoice3LM.inference asserts (llm.py:477-479)


def prompt_analysis(cv: Any, prompts_dir: Path, checkpoint: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """What the official frontend extracts from each prompt file (before the trim to feat = 2 x tokens)."""
    from cosyvoice.utils.file_utils import load_wav

    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {}
    frontend = cv.frontend
    for name, text in PROMPTS.items():
        path = prompts_dir / f"{name}.wav"
        log: dict[str, Any] = {}

        def feat_extractor(original: Any, speech: Any, _log: dict[str, Any] = log) -> Any:
            out = original(speech)
            _log["feat"] = (to_numpy(speech), to_numpy(out))
            return out

        with (
            wrapped(frontend.speech_tokenizer_session, "run", _session_recorder(log, "tokenizer")),
            wrapped(frontend.campplus_session, "run", _session_recorder(log, "campplus")),
            wrapped(frontend, "feat_extractor", feat_extractor),
        ):
            tokens, _ = frontend._extract_speech_token(str(path))
            embedding = frontend._extract_spk_embedding(str(path))
            feat, _ = frontend._extract_speech_feat(str(path))
        p = f"{name}_"
        arrays[p + "speech_16k"] = to_numpy(load_wav(str(path), 16000))[0]
        arrays[p + "speech_24k"] = log["feat"][0][0]
        arrays[p + "fbank"] = next(iter(log["campplus"][0].values()))[0]
        arrays[p + "embedding"] = to_numpy(embedding)[0]
        arrays[p + "whisper_mel"] = next(iter(log["tokenizer"][0].values()))[0]
        arrays[p + "tokenizer_out"] = log["tokenizer"][1][0]
        arrays[p + "speech_token"] = to_numpy(tokens)[0].astype(np.int32)
        arrays[p + "mel80"] = to_numpy(feat)[0]
        assert np.array_equal(arrays[p + "mel80"], log["feat"][1][0].T)
        margin = fsq_margin(checkpoint / TOKENIZER_FILE, log["tokenizer"][0])
        if margin is not None:
            arrays[p + "fsq_margin"] = margin
        trimmed = min(arrays[p + "mel80"].shape[0] // 2, arrays[p + "speech_token"].shape[0])
        meta[name] = _prompt_meta(path, text, arrays, p, trimmed, margin)
    return arrays, meta


def _text_case(frontend: Any, name: str, text: str) -> dict[str, Any]:
    sentences = list(frontend.text_normalize(text, split=True))
    ids = [to_numpy(frontend._extract_text_token(s)[0])[0].tolist() for s in sentences]
    raw_ids = frontend.tokenizer.encode(text)
    return {
        "name": name,
        "text": text,
        "skips_frontend": "<|" in text and "|>" in text,
        "normalized_sentences": sentences,
        "normalized_joined": frontend.text_normalize(text, split=False),
        "ids": ids,
        "raw_ids": raw_ids,
        "end_of_prompt_at": [i for i, t in enumerate(raw_ids) if t == END_OF_PROMPT_ID],
    }


def tokenizer_fixture(cv: Any, checkpoint: Path) -> dict[str, Any]:
    """Text cases, the 26 official instruct presets with their ids, and the tokenizer pipeline with every added token."""
    from cosyvoice.utils.common import instruct_list

    frontend = cv.frontend
    tokenizer = frontend.tokenizer
    listed = tokenizer.special_tokens["additional_special_tokens"]
    base = len(tokenizer.tokenizer) - len(tokenizer.tokenizer.get_added_vocab())
    return {
        "tokenizer": describe_tokenizer(tokenizer, checkpoint),
        "additional_special_tokens_listed": len(listed),
        "additional_special_tokens_new": sum(1 for t in listed if tokenizer.tokenizer.convert_tokens_to_ids(t) > 151645),
        "bpe_vocab": base,
        "cases": [_text_case(frontend, name, text) for name, text in TOKENIZER_TEXTS.items()],
        "instruct_presets": [{"index": i, "text": text, "ids": tokenizer.encode(text)} for i, text in enumerate(instruct_list)],
    }
