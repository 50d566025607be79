"""CosyVoice2-0.5B's bundle contract, shared with export/: its graphs and their inputs and outputs, its prompt models and
files, and the constants its manifest section holds. Imports only service.bundle (the exporter reads it too)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from service.bundle import SPEAKERS_NAME, FamilyLayout, Manifest
from service.errors import BundleError

FAMILY = "cosyvoice2"  # CosyVoice2-0.5B
TOKENIZER_NAME = "tokenizer.json"  # the Qwen2 byte-level BPE with CosyVoice's special tokens (`tokenizers` format)
NOISE_NAME = "flow_noise.npy"  # the flow's fixed noise buffer (80, 15000) float32 (official rand_noise)
HIFT_IO: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "hift_f0": (("mel",), ("f0",)),
    "hift_source": (("sine",), ("source",)),
    "hift_decode": (("mel", "s_stft"), ("x",)),
}
# Graphs. Templates: `{i}` one name per LLM layer, `{e}` per token-rate encoder block, `{u}` per up-sampled encoder
# block, `{b}` per estimator transformer block (counts in the manifest's `cosyvoice2` section: CosyVoice2Constants).
GRAPH_IO: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llm_prompt": (("text_ids",), ("x",)),
    "llm_embed": (("token",), ("x",)),
    "llm_step": (("x", "past_len", "past_k_{i}", "past_v_{i}"), ("logp", "new_k", "new_v")),
    "flow_speaker": (("embedding",), ("spks",)),
    "flow_encoder": (
        ("tokens", "context", "chunk", "look_ahead", "up_tail", "enc_k_{e}", "enc_v_{e}", "up_k_{u}", "up_v_{u}"),
        ("h", "look_ahead_out", "up_tail_out", "enc_new_k", "enc_new_v", "up_new_k", "up_new_v"),
    ),
    "flow_estimator": (
        ("x", "mu", "t", "spks", "cond", "chunk", "tails", "past_k_{b}", "past_v_{b}"),
        ("v", "tails_out", "new_k", "new_v"),
    ),
    **HIFT_IO,
}
# The prompt models: CAM++ and a 25 Hz speech tokenizer (inputs feats, feats_length; output indices).
PROMPT_GRAPHS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "campplus": ("campplus.onnx", ("input",), ("output",)),
    "speech_tokenizer": ("speech_tokenizer_v2.onnx", ("feats", "feats_length"), ("indices",)),
}
LAYOUT = FamilyLayout(
    FAMILY, GRAPH_IO, PROMPT_GRAPHS, TOKENIZER_NAME, (SPEAKERS_NAME, NOISE_NAME), native_graphs=("flow_estimator", "llm_step")
)


@dataclass(frozen=True)
class CosyVoice2Constants:
    """CosyVoice2 facts beyond ModelConstants: stop tokens, the flow's chunk geometry and its cache shapes.

    In a CosyVoice2 manifest ModelConstants reads: llm_num_heads = the LLM's K/V heads (grouped-query attention),
    token_hop_len / token_max_hop_len / stream_scale_factor = the streaming hop schedule (25, 100, 2), mel_cache_len
    = the vocoder's mel overlap (8 frames), token_overlap_len = 0 (no flow overlap: the flow keeps caches).
    """

    stop_tokens: int = 3  # speech_token_size + 0..2 all end the utterance
    text_vocab_size: int = 151936
    chunk_tokens: int = 25  # static_chunk_size: attention chunk of the encoder (x token_mel_ratio for the estimator)
    token_mel_ratio: int = 2
    pre_lookahead: int = 3  # tokens of look-ahead the encoder reads past a chunk
    encoder_blocks: int = 6
    up_blocks: int = 4
    encoder_heads: int = 8
    encoder_head_dim: int = 64
    encoder_dim: int = 512
    conv_tail: int = 2  # left context kept by every causal convolution
    estimator_blocks: int = 56
    estimator_heads: int = 8
    estimator_head_dim: int = 64
    estimator_tail_channels: int = 8256  # sum of the estimator's causal-conv input channels (the `tails` input)
    noise_frames: int = 15000

    def graph_counts(self) -> dict[str, int]:
        """Template counts of V2_GRAPH_IO besides `{i}`."""
        return {"e": self.encoder_blocks, "u": self.up_blocks, "b": self.estimator_blocks}


def constants_of(manifest: Manifest) -> CosyVoice2Constants:
    """The manifest's `cosyvoice2` section as CosyVoice2Constants (BundleError when it is missing or malformed)."""
    if manifest.family != FAMILY:
        raise BundleError(f"not a CosyVoice2 bundle (family {manifest.family!r})")
    known = {f.name for f in dataclasses.fields(CosyVoice2Constants)}
    section = manifest.family_section
    unknown = sorted(set(section) - known)
    if not section or unknown:
        raise BundleError(f"manifest section {FAMILY!r} is missing or has unknown keys {unknown}")
    try:
        return CosyVoice2Constants(**section)
    except TypeError as e:
        raise BundleError(f"manifest section {FAMILY!r} is malformed: {e}") from e
