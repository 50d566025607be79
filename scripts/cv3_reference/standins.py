"""Functional stand-ins for campplus.onnx and speech_tokenizer_v3.onnx (tiny random weights, the frontend's signatures).

CAM++ is the same model in every CosyVoice release: its stand-in is CosyVoice2's (`cv2_reference.standins.campplus`).
The S3 tokenizer v3 has 12 transformer blocks where v2 has 6 (s3tokenizer 0.3.0, `model_v3.py:34` against
`model_v2.py:31`) and the same FSQ codebook (3^8 = 6561 codes, 25 tokens/s); the official frontend feeds it exactly
as v2 (`cosyvoice/cli/frontend.py:95-106`: input 0 the 128-bin whisper log-mel [1, 128, T], input 1 its length as
int32 [1]; output 0 flattened). Its stand-in is therefore the v2 stand-in graph with other random weights.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from cv2_reference.standins import campplus, speech_tokenizer_v2

CAMPPLUS_SEED_OFFSET = 11  # as in the CosyVoice2 stand-ins
TOKENIZER_SEED_OFFSET = 33


def speech_tokenizer_v3(seed: int) -> onnx.ModelProto:
    """The v2 stand-in graph (mask, two stride-2 convolutions, FSQ) with weights from `seed`, named for v3."""
    model = speech_tokenizer_v2(seed)
    model.graph.name = "speech_tokenizer_v3_standin"
    model.producer_name = "cv3_reference.standins"
    onnx.checker.check_model(model, full_check=True)
    return model


def write_standins(out_dir: Path, seed: int) -> None:
    """campplus.onnx and speech_tokenizer_v3.onnx into `out_dir`."""
    onnx.save(campplus(seed + CAMPPLUS_SEED_OFFSET), str(out_dir / "campplus.onnx"))
    onnx.save(speech_tokenizer_v3(seed + TOKENIZER_SEED_OFFSET), str(out_dir / "speech_tokenizer_v3.onnx"))
