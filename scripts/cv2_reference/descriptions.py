"""What each fixture array holds (the README's array tables are generated from these patterns)."""

from __future__ import annotations

import re

PREFIX = re.compile(r"^(?:case\d+_|zs_|cl_|i2_)?(?:k(?P<chunk>\d+)_)?")
PROMPT_PREFIX = re.compile(r"^(zh_16k|en_24k|en_48k_stereo)_")

MEANINGS = {
    # prompts.npz
    "speech_16k": "`load_wav(file, 16000)`: channel mean, torchaudio Resample when the file rate differs [samples]",
    "speech_24k": "`load_wav(file, 24000)`: what `feat_extractor` gets [samples]",
    "fbank": (
        "`kaldi.fbank(speech_16k, num_mel_bins=80, dither=0, sample_frequency=16000)` minus its mean over "
        "frames = CAM++ input [frames, 80]"
    ),
    "embedding": "CAM++ output (stand-in here): `llm_embedding` = `flow_embedding` of the model input, raw [192]",
    "whisper_mel": "`whisper.log_mel_spectrogram(speech_16k, n_mels=128)` = speech tokenizer input `feats` [128, frames]",
    "tokenizer_out": "raw speech_tokenizer_v2 output `indices` (stand-in: [1, T2] int64)",
    "speech_token": "flattened speech tokens before the CosyVoice2 trim [T_tok] (25 Hz)",
    "fsq_margin": "stand-in only: per token, min over the 8 FSQ dims of ||x| - 0.5| before rounding (how near a flip)",
    "mel80": (
        "`feat_extractor(speech_24k)` transposed: 80-bin log mel, n_fft 1920, hop 480, fmax 8000 [frames, 80], before the trim"
    ),
    # model input
    "mi_text": "model input `text`: ids of the normalized tts sentence (Qwen2 BPE + CosyVoice2 special tokens)",
    "mi_prompt_text": "model input `prompt_text`: prompt transcript ids (zero-shot) or instruct ids (instruct2)",
    "mi_llm_prompt_speech_token": "model input `llm_prompt_speech_token` (zero-shot only): trimmed prompt tokens",
    "mi_flow_prompt_speech_token": "model input `flow_prompt_speech_token`: trimmed prompt tokens [P_tok]",
    "mi_prompt_speech_feat": "model input `prompt_speech_feat`: prompt mel trimmed to 2 x P_tok frames [P, 80]",
    "mi_embedding": "model input `flow_embedding` (= `llm_embedding`, which Qwen2LM ignores) [192]",
    # LLM
    "forced_tokens": "speech tokens forced on the LLM (teacher forcing, then EOS) = the tokens the flow receives [N]",
    "llm_prefill_input": (
        "input embeddings of the first `forward_one_step`: [sos, text_emb(prompt_text ++ text), task_id, "
        "speech_emb(llm prompt tokens)] [L, H]"
    ),
    "llm_step_hidden": (
        "`hidden_states[-1][:, -1]` of each `forward_one_step` (row 0 prefill, then one token per step, HF KV cache) [N+1, H]"
    ),
    "llm_step_past": "KV-cache length before each `forward_one_step` (0, L, L+1, ...) [N+1]",
    "llm_logp_rows": (
        "full log_softmax(llm_decoder(hidden)) over 6564 classes for the rows in `llm_logp_row_index`, before EOS masking"
    ),
    "llm_logp_row_index": "which steps `llm_logp_rows` / `llm_nocache_logp_rows` hold (first, second, last)",
    "llm_logp_taken": "log-prob of the token taken at each step (the forced token, EOS = 6561 at the last step) [N+1]",
    "llm_logp_eos": "log-prob of EOS (6561) at each step [N+1]",
    "llm_ignore_eos": "whether the official loop masked EOS at that step (step < min_len = 2 x len(text)) [N+1]",
    "llm_nocache_hidden": (
        "harness extra: the same hidden states from ONE causal `Qwen2Encoder.forward` over prefill ++ forced tokens [N+1, H]"
    ),
    "llm_nocache_logp_rows": "harness extra: log-probs of `llm_nocache_hidden` at the rows of `llm_logp_row_index`",
    # flow
    "flow_mu": (
        "`mu` given to the solver = encoder_proj(encoder(prompt ++ tokens)) transposed [80, P + T] (non-stream: full attention)"
    ),
    "flow_spks": "`spk_embed_affine_layer(l2norm(embedding))` [80]",
    "flow_solver_out": "solver output over prompt + new frames [80, P + T]; the flow mel is `[:, P:]`",
    "flow_encoder_h": "encoder output before encoder_proj (after_norm) [2 x (P_tok + N), 512]",
    "est1_out": "estimator output at Euler step 1 for the CFG batch (row 0 conditional, row 1 unconditional) [2, 80, frames]",
    "flow_new_mu": "this chunk's new frames of the solver `mu` (from 2 x token_offset) [80, new frames]",
    "flow_new_mel": "this chunk's new flow mel = `feat[:, :, 2 x token_offset:]` as token2wav cuts it [80, new frames]",
    "extra_final_chunkmask_new_mel": (
        "harness extra: the final chunk's new mel had the flow run with chunk masks (streaming=True)"
    ),
    # HiFT
    "hift_mel": "mel given to `hift.inference` (streaming: the 8 cached frames + the new frames) [80, frames]",
    "hift_f0": "f0 from ConvRNNF0Predictor [frames]",
    "hift_rand_ini": "SineGen2's `torch.rand(1, 9)` initial phases; they never reach the output at 24 kHz (see HiFT) [9]",
    "hift_source": "excitation `s` actually used by `decode` (after the cache_source overwrite) [480 x frames]",
    "hift_speech": "`hift.inference` output = the yielded audio in non-stream mode [480 x frames]",
    "yielded": (
        "audio yielded for this chunk: HiFT output, head cross-faded with the previous chunk's tail (hamming(7680)), "
        "last 3840 samples held back unless final [samples]"
    ),
    "speech_tail": "the 3840 samples held back for the next chunk's cross-fade (hift cache 'speech')",
    "chunk_offset": "token_offset of each token2wav call",
    "chunk_token_len": "tokens handed to each token2wav call (offset + hop + 3 look-ahead; all tokens for the final call)",
    "chunk_finalize": "finalize flag of each call",
    "chunk_flow_streaming": "the `streaming` flag flow.inference received (False for the final call: full attention)",
    "chunk_flow_frames": "frames the flow solved in each call (prompt + all tokens so far: the recompute)",
    "chunk_new_mel_frames": "new mel frames each call contributes",
    "chunk_hift_mel_frames": "mel frames HiFT received (8 cached + new)",
    "chunk_cache_source_samples": "cache_source samples overwriting the head of the excitation (0, then 3840)",
    "chunk_yielded_samples": "samples yielded per chunk",
    # hift.npz
    "mel": "mel given to `hift.inference` [80, frames]",
    "f0": "f0 actually used (predicted, or the injected contour) [frames]",
    "rand_ini": "`torch.rand(1, 9)` draw of SineGen2 [9]",
    "sine_noise": "`torch.randn_like(sine_waves)` draw of SineGen2 [samples, 9]",
    "source": "excitation used by `decode` [samples]",
    "cache_source": "`cache_source` argument (its samples replace the head of the excitation) [samples]",
    "speech": "HiFT output [samples]",
    # flow_noise.npz
    "rand_noise": (
        "prefix of the fixed `CausalConditionalCFM.rand_noise` buffer: z = rand_noise[:, :, :frames] in every call [80, frames]"
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
