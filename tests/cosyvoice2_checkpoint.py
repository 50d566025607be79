"""A small random CosyVoice2 checkpoint in the official layout, written by our own torch modules (tests of the exporter).

Not the official code's output (tests/reference/tiny-cosyvoice2 is): its state dicts have the official key names
because our modules load those strictly, so the exporter reads it like a released checkpoint.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from export.cosyvoice2.config import load_config
from export.cosyvoice2.modules.flow import CausalMaskedDiffWithXvec
from export.cosyvoice2.modules.llm import Qwen2LM
from export.modules.hift import HiFTGenerator

REPO = Path(__file__).resolve().parents[1]
FULL_CONFIG = REPO / "export" / "configs" / "cosyvoice2-0.5b"
V1_CAMPPLUS = REPO / "tests" / "reference" / "tiny" / "campplus.onnx"
# full-size yaml line -> small value (the flow encoder stays 512 wide: the official layers are built at 512)
YAML_SIZES = {
    "llm_input_size: 896": "llm_input_size: 32",
    "llm_output_size: 896": "llm_output_size: 32",
    "        linear_units: 2048\n        num_blocks: 6": "        linear_units: 64\n        num_blocks: 1",
    "channels: [256]": "channels: [16]",
    "attention_head_dim: 64": "attention_head_dim: 8",
    "n_blocks: 4": "n_blocks: 1",
    "num_mid_blocks: 12": "num_mid_blocks: 2",
    "num_heads: 8": "num_heads: 2",
    "base_channels: 512": "base_channels: 16",
    "cond_channels: 512": "cond_channels: 16",
}
QWEN = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
# A byte-level BPE of 256 byte symbols and a few merges (the tokenizer files' format, not Qwen's vocabulary).
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("t", "h"), ("i", "n"), ("e", "r")]


def write_tokenizer_files(blank: Path) -> None:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    vocab = {symbols[b]: b for b in range(256)}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    (blank / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (blank / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES), encoding="utf-8")


class _Tokenizer25Hz(torch.nn.Module):
    """Stand-in speech_tokenizer_v2: whisper mel (B,128,T) -> (B, ceil(T/4)) ids in 0..6560."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(128, 16, 4, stride=4, padding=2)
        self.out = torch.nn.Linear(16, 6561)

    def forward(self, feats: torch.Tensor, feats_length: torch.Tensor) -> torch.Tensor:
        ids = self.out(self.conv(feats).transpose(1, 2)).argmax(-1)
        return ids + (feats_length.to(torch.int64) * 0).unsqueeze(1)


def write_prompt_models(out: Path) -> None:
    shutil.copyfile(V1_CAMPPLUS, out / "campplus.onnx")
    torch.onnx.export(
        _Tokenizer25Hz(),
        (torch.randn(1, 128, 100), torch.tensor([100], dtype=torch.int32)),
        str(out / "speech_tokenizer_v2.onnx"),
        input_names=["feats", "feats_length"],
        output_names=["indices"],
        dynamic_axes={"feats": {0: "B", 2: "T"}, "feats_length": {0: "B"}, "indices": {0: "B", 1: "N"}},
        opset_version=13,
        dynamo=False,
    )


def build_checkpoint(out: Path, *, seed: int = 0, prompt_models: bool = True) -> Path:
    """Write cosyvoice2.yaml, CosyVoice-BlankEN/ (config + tokenizer files), llm.pt, flow.pt, hift.pt (+ prompt models)."""
    out.mkdir(parents=True, exist_ok=True)
    text = (FULL_CONFIG / "cosyvoice2.yaml").read_text(encoding="utf-8")
    for full, small in YAML_SIZES.items():
        assert full in text, full
        text = text.replace(full, small)
    (out / "cosyvoice2.yaml").write_text(text, encoding="utf-8")
    blank = out / "CosyVoice-BlankEN"
    blank.mkdir(exist_ok=True)
    qwen = json.loads((FULL_CONFIG / "CosyVoice-BlankEN" / "config.json").read_text(encoding="utf-8")) | QWEN
    (blank / "config.json").write_text(json.dumps(qwen), encoding="utf-8")
    write_tokenizer_files(blank)
    cfg = load_config(out)
    torch.manual_seed(seed)
    llm = Qwen2LM(cfg.llm)
    state = llm.state_dict()
    state["llm.model.lm_head.weight"] = state["llm.model.model.embed_tokens.weight"]  # tied, as in the released file
    torch.save(state, out / "llm.pt")
    torch.save(CausalMaskedDiffWithXvec(cfg.flow).state_dict(), out / "flow.pt")
    torch.save(HiFTGenerator(cfg.hift).state_dict(), out / "hift.pt")
    if prompt_models:
        write_prompt_models(out)
    return out


EXPORT_FLAGS = ("--verify", "--test-model", "--quantize", "int8")


def run_export(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """export/export_onnx.py in a child process (as a user runs it)."""
    script = REPO / "export" / "export_onnx.py"
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True, timeout=1200, cwd=REPO)


def export_checkpoint(checkpoint: Path, out: Path) -> Path:
    """Export with EXPORT_FLAGS; fails the calling test with the exporter's stderr when it does not succeed."""
    proc = run_export("--model-dir", checkpoint, "--out", out, *EXPORT_FLAGS)
    if proc.returncode != 0 or "FAIL" in proc.stdout:
        raise AssertionError(f"export failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return out
