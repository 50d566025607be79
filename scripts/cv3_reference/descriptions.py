"""What each CosyVoice3 fixture array holds (the README's array tables are generated from these patterns)."""

from __future__ import annotations

import re

from cv2_reference.descriptions import MEANINGS as CV2_MEANINGS

PREFIX = re.compile(r"^(?:case\d+_|zs_|cl_|i2_)?(?:k(?P<chunk>\d+)_)?")
PROMPT_PREFIX = re.compile(r"^(zh_16k|en_24k|en_48k_stereo)_")
KEPT = [
    "speech_16k",
    "speech_24k",
    "fbank",
    "embedding",
    "whisper_mel",
    "fsq_margin",
    "mi_prompt_text",
    "mi_llm_prompt_speech_token",
    "mi_flow_prompt_speech_token",
    "mi_prompt_speech_feat",
    "llm_step_past",
    "llm_logp_row_index",
    "llm_nocache_logp_rows",
    "flow_spks",
    "flow_new_mel",
    "flow_new_mu",
    "flow_solver_out",
    "extra_final_chunkmask_new_mel",
    "chunk_offset",
    "chunk_finalize",
    "chunk_flow_streaming",
    "chunk_new_mel_frames",
    "chunk_yielded_samples",
]

MEANINGS = {key: CV2_MEANINGS[key] for key in KEPT} | {
    # prompts.npz
    "tokenizer_out": "raw speech_tokenizer_v3 output `indices` (stand-in: [1, T2] int64)",
    "speech_token": "flattened speech tokens before the trim [T_tok] (25 Hz)",
    "mel80": (
        "`feat_extractor(speech_24k)` transposed: 80-bin log mel, n_fft 1920, hop 480, fmax None [frames, 80], before the trim"
    ),
    # model input
    "mi_text": "model input `text`: ids of the tts sentence (Qwen2 BPE + CosyVoice3 special tokens)",
    "mi_embedding": "model input `flow_embedding` (= `llm_embedding`, which CosyVoice3LM ignores) [192]",
    # LLM
    "forced_tokens": "speech tokens forced on the LLM (teacher forcing, then eos 6562) [N]",
    "flow_tokens": "tokens the flow received: `forced_tokens` after the official silent-token filter (at most 5 in a row)",
    "llm_prefill_input": (
        "input embeddings of the first `forward_one_step`: [speech_emb[6561] (sos), text_emb(prompt_text ++ text), "
        "speech_emb[6563] (task), speech_emb(llm prompt tokens)] [L, H]"
    ),
    "llm_step_hidden": "`hidden_states[-1][:, -1]` of each `forward_one_step` (row 0 prefill, then one token per step) [N+1, H]",
    "llm_logp_rows": "full log_softmax(llm_decoder(hidden)) over 6761 classes for the rows in `llm_logp_row_index`",
    "llm_logp_taken": "log-prob of the token taken at each step (the forced token; eos 6562 at the last step) [N+1]",
    "llm_logp_eos": "log-prob of eos (6562) at each step [N+1]",
    "llm_ignore_eos": "the `ignore_eos` flag the official loop passed (step < min_len; it masks id 6561, see README) [N+1]",
    "llm_nocache_hidden": (
        "harness extra: the same hidden states from ONE causal `Qwen2Encoder.forward` over prefill ++ forced [N+1, H]"
    ),
    # flow
    "flow_lookahead_h": (
        "`pre_lookahead_layer` output over prompt ++ tts tokens [P_tok + N (- 3 held back), 80]; mu = it x 2 frames"
    ),
    "est1_out": "DiT output at Euler step 1 for the CFG batch (row 0 conditional, row 1 unconditional) [2, 80, frames]",
    "dit1_time_embed": "DiT `time_embed(t)` at Euler step 1 (t = 0 in both rows) [2, D]",
    "dit1_input_embed": (
        "DiT `input_embed(x, cond, mu, spks)` at Euler step 1 (proj + causal conv position embedding) [2, frames, D]"
    ),
    "dit1_block0": "DiT block 0 output at Euler step 1 [2, frames, D]",
    "dit1_block1": "DiT block 1 output at Euler step 1 [2, frames, D]",
    "dit1_norm_out": "DiT `norm_out` (final AdaLN) output at Euler step 1, before `proj_out` [2, frames, D]",
    # HiFT
    "hift_f0": "f0 from CausalConvRNNF0Predictor, float64 as the official code computes it (cast to float32 before use) [frames]",
    "hift_source": "excitation `s` (SineGen2 causal + l_linear + tanh) over the whole mel given to HiFT [480 x frames]",
    "hift_speech": "`hift.inference` output = the yielded audio in non-stream mode [480 x frames]",
    "yielded": "audio yielded for this chunk: the HiFT re-run over the whole mel history from the previous speech offset on",
    "chunk_token_len": "tokens handed to each token2wav call (offset + hop + 3 look-ahead; all tokens for the final call)",
    "chunk_flow_frames": "frames the DiT solved in each call (prompt + all tokens so far: the recompute)",
    "chunk_hift_mel_frames": "mel frames HiFT received (the whole history: every chunk's new frames so far)",
    "chunk_hift_out_samples": "samples HiFT returned (non-final calls hold back 3 + 4 frames of look-ahead)",
    # hift.npz
    "mel": "mel given to `hift.inference` [80, frames]",
    "f0": "f0 actually used, float64 (predicted, or the injected contour) [f0 frames]",
    "source": "excitation used by `decode` [samples]",
    "speech": "HiFT output [samples]",
    # noise.npz
    "flow_rand_noise": (
        "prefix of the fixed `CausalConditionalCFM.rand_noise`: z = rand_noise[:, :, :frames] in every call [80, frames]"
    ),
    "hift_rand_ini": "`SineGen2.rand_ini` (torch.rand(1, 9), first harmonic zeroed) added to the first sample's phase [9]",
    "hift_sine_waves": (
        "prefix of `SineGen2.sine_waves` (torch.rand, uniform [0, 1)): noise = amp x sine_waves[:, :samples] [samples, 9]"
    ),
}


def describe_array(name: str) -> str:
    """The meaning of a stored array name (prefixes: caseN_, zs_/cl_/i2_ runs, kN_ chunks, prompt names)."""
    stripped = PROMPT_PREFIX.sub("", name)
    match = PREFIX.match(stripped)
    key = stripped[match.end() :] if match else stripped
    meaning = MEANINGS.get(key)
    if meaning is None:
        raise KeyError(f"no description for fixture array {name!r}")
    if match and match.group("chunk") is not None:
        meaning = f"chunk {match.group('chunk')}: {meaning}"
    return meaning
