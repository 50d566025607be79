"""Prompt analysis (load_wav, Kaldi fbank + CAM++, whisper log-mel + S3 tokenizer v2, 24 kHz mel) and text fixtures."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from cv2_reference.cases import PROMPTS, TOKENIZER_TEXTS
from cv2_reference.recorder import to_numpy, wrapped
from cv2_reference.standins import FSQ_PRE_ROUND


def _session_recorder(log: dict[str, Any], key: str) -> Any:
    def run(original: Any, output_names: Any, feed: dict[str, Any], *args: Any) -> Any:
        outputs = original(output_names, feed, *args)
        log[key] = ({name: np.array(value, copy=True) for name, value in feed.items()}, [np.array(o, copy=True) for o in outputs])
        return outputs

    return run


def fsq_margin(model_path: Path, feed: dict[str, np.ndarray]) -> np.ndarray | None:
    """Stand-in tokenizer only: per token, the distance of the closest FSQ value to a rounding boundary (|x| = 0.5)."""
    import onnx
    import onnxruntime

    model = onnx.load(str(model_path))
    if not any(FSQ_PRE_ROUND in node.output for node in model.graph.node):
        return None
    model.graph.output.append(onnx.helper.make_tensor_value_info(FSQ_PRE_ROUND, onnx.TensorProto.FLOAT, None))
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    scaled = session.run([FSQ_PRE_ROUND], feed)[0][0]
    return np.abs(np.abs(scaled) - 0.5).min(axis=-1).astype(np.float32)


def prompt_analysis(cv: Any, prompts_dir: Path, checkpoint: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """What the official frontend extracts from each prompt file (before the CosyVoice2 trim to feat = 2 x tokens)."""
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
        tok_feed, tok_out = log["tokenizer"]
        cam_feed, cam_out = log["campplus"]
        mel_in, mel_out = log["feat"]
        p = f"{name}_"
        arrays[p + "speech_16k"] = to_numpy(load_wav(str(path), 16000))[0]
        arrays[p + "speech_24k"] = mel_in[0]
        arrays[p + "fbank"] = next(iter(cam_feed.values()))[0]
        arrays[p + "embedding"] = to_numpy(embedding)[0]
        arrays[p + "whisper_mel"] = next(iter(tok_feed.values()))[0]
        arrays[p + "tokenizer_out"] = tok_out[0]
        arrays[p + "speech_token"] = to_numpy(tokens)[0].astype(np.int32)
        arrays[p + "mel80"] = to_numpy(feat)[0]
        assert np.array_equal(arrays[p + "mel80"], mel_out[0].T) and np.allclose(cam_out[0][0], arrays[p + "embedding"])
        margin = fsq_margin(checkpoint / "speech_tokenizer_v2.onnx", tok_feed)
        if margin is not None:
            arrays[p + "fsq_margin"] = margin
        trimmed = min(arrays[p + "mel80"].shape[0] // 2, arrays[p + "speech_token"].shape[0])
        meta[name] = _prompt_meta(path, text, arrays, p, trimmed, margin)
    return arrays, meta


def _prompt_meta(path: Path, text: str, arrays: dict[str, np.ndarray], p: str, trimmed: int, margin: Any) -> dict[str, Any]:
    import soundfile

    info = soundfile.info(str(path))
    return {
        "file": f"prompts/{path.name}",
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "sample_rate": info.samplerate,
        "channels": info.channels,
        "frames": info.frames,
        "prompt_text": text,
        "samples_16k": int(arrays[p + "speech_16k"].shape[0]),
        "samples_24k": int(arrays[p + "speech_24k"].shape[0]),
        "fbank_frames": int(arrays[p + "fbank"].shape[0]),
        "whisper_mel_frames": int(arrays[p + "whisper_mel"].shape[1]),
        "speech_tokens": int(arrays[p + "speech_token"].shape[0]),
        "mel80_frames": int(arrays[p + "mel80"].shape[0]),
        "trimmed_tokens": trimmed,
        "trimmed_mel_frames": 2 * trimmed,
        "min_fsq_margin": None if margin is None else float(margin.min()),
    }


def tokenizer_fixture(cv: Any, checkpoint: Path) -> dict[str, Any]:
    """Normalized sentences and token ids of TOKENIZER_TEXTS, plus a description of the tokenizer pipeline."""
    frontend = cv.frontend
    cases = []
    for name, text in TOKENIZER_TEXTS.items():
        sentences = list(frontend.text_normalize(text, split=True))
        ids = [to_numpy(frontend._extract_text_token(s)[0])[0].tolist() for s in sentences]
        cases.append(
            {
                "name": name,
                "text": text,
                "normalized_sentences": sentences,
                "normalized_joined": frontend.text_normalize(text, split=False),
                "ids": ids,
                "raw_ids": frontend.tokenizer.encode(text),
            }
        )
    return {"tokenizer": describe_tokenizer(frontend.tokenizer, checkpoint), "cases": cases}


def describe_tokenizer(tokenizer: Any, checkpoint: Path) -> dict[str, Any]:
    """The pieces a `tokenizers`-based re-implementation needs besides vocab.json and merges.txt."""
    hf = tokenizer.tokenizer
    backend = json.loads(hf.backend_tokenizer.to_str())
    model = {k: v for k, v in backend["model"].items() if k not in ("vocab", "merges")}
    blank = checkpoint / "CosyVoice-BlankEN"
    return {
        "class": f"{type(tokenizer).__name__} -> transformers {type(hf).__name__}",
        "encode": "tokenizer([text])['input_ids'][0]: no special tokens added around the text",
        "len": len(hf),
        "added_tokens": [
            {"id": t["id"], "content": t["content"], "special": t["special"], "normalized": t["normalized"]}
            for t in backend["added_tokens"]
        ],
        "normalizer": backend["normalizer"],
        "pre_tokenizer": backend["pre_tokenizer"],
        "decoder": backend["decoder"],
        "model": model,
        "files_sha256": {
            f: hashlib.sha256((blank / f).read_bytes()).hexdigest() for f in ("vocab.json", "merges.txt", "tokenizer_config.json")
        },
    }
