"""The Fun-CosyVoice3 reference builders (scripts/cv3_reference) reproduce tests/reference/tiny-cosyvoice3, whose
recorded official runs follow the rules its README and docs/cosyvoice3-official.md state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from conftest import TINY_COSYVOICE2_REF, TINY_COSYVOICE3_REF
from cv2_reference import checkpoint as ck
from cv2_reference.environment import git_object_id
from cv3_reference import checkpoint as ck3
from cv3_reference import readme_tables
from cv3_reference.cases import MAX_SILENT_RUN, SILENT_TOKENS
from cv3_reference.standins import write_standins
from test_cosyvoice2_reference import official_schedule

OFFICIAL_YAML_BLOB = "36dfee4889b6f1c5a1e85e59a0e716005aa0063f"  # examples/libritts/cosyvoice3/conf/cosyvoice3.yaml at ace7c47
END_OF_PROMPT, END_OF_SYSTEM = 151646, 151663
EOS = 6562
FRAME = 480  # samples per mel frame
HIFT_HELD_BACK = 8  # frames a non-final causal HiFT call does not return: 3 (f0) + 4 (conv_pre) + 1 (decode's cut)


def fixture_meta() -> dict[str, Any]:
    return json.loads((TINY_COSYVOICE3_REF / "fixtures_meta.json").read_text(encoding="utf-8"))


def load(name: str) -> dict[str, np.ndarray]:
    with np.load(TINY_COSYVOICE3_REF / f"{name}.npz") as data:
        return {key: data[key] for key in data.files}


def silence_filtered(tokens: list[int]) -> list[int]:
    """The official llm_job filter, as docs/cosyvoice3-official.md states it: a silent token after 5 in a row is dropped."""
    out, run = [], 0
    for token in tokens:
        run = run + 1 if token in SILENT_TOKENS else 0
        if run <= MAX_SILENT_RUN:
            out.append(token)
    return out


def test_the_tokenizer_files_are_the_cosyvoice2_ones() -> None:
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        ours = (TINY_COSYVOICE3_REF / ck3.BLANK / name).read_bytes()
        assert ours == (TINY_COSYVOICE2_REF / ck3.BLANK / name).read_bytes(), name


def test_full_size_values_turn_the_tiny_yaml_back_into_the_official_file() -> None:
    tiny_text = (TINY_COSYVOICE3_REF / ck3.YAML_NAME).read_text(encoding="utf-8")
    official, changes = ck3.resized_yaml(tiny_text, ck3.FULL)
    assert git_object_id("blob", official.encode()).hex() == OFFICIAL_YAML_BLOB
    assert [label for label, _, _ in changes] == [label for label, *_ in ck3.YAML_EDITS]
    assert ck3.resized_yaml(official, ck3.SIZES["tiny"])[0] == tiny_text


def test_the_qwen2_config_is_the_tiny_size() -> None:
    config = json.loads((TINY_COSYVOICE3_REF / ck3.BLANK / "config.json").read_text(encoding="utf-8"))
    assert config == ck.qwen2_config(ck3.SIZES["tiny"])  # type: ignore[arg-type]


def test_the_stand_ins_rebuild_byte_for_byte_and_campplus_is_cosyvoice2s(tmp_path: Path) -> None:
    write_standins(tmp_path, 0)
    for name in ("campplus.onnx", "speech_tokenizer_v3.onnx"):
        assert (tmp_path / name).read_bytes() == (TINY_COSYVOICE3_REF / name).read_bytes(), name
    assert (TINY_COSYVOICE3_REF / "campplus.onnx").read_bytes() == (TINY_COSYVOICE2_REF / "campplus.onnx").read_bytes()


def test_the_tokenizer_stand_in_has_the_frontend_signature_and_depends_on_its_input() -> None:
    session = ort.InferenceSession(str(TINY_COSYVOICE3_REF / "speech_tokenizer_v3.onnx"), providers=["CPUExecutionProvider"])
    assert [(i.name, i.type) for i in session.get_inputs()] == [("feats", "tensor(float)"), ("feats_length", "tensor(int32)")]
    feats = np.random.default_rng(0).standard_normal((1, 128, 401)).astype(np.float32)
    codes = session.run(None, {"feats": feats, "feats_length": np.array([401], np.int32)})[0]
    assert codes.shape == (1, 101) and codes.min() >= 0 and codes.max() < 6561 and len(set(codes[0].tolist())) > 50
    v2 = ort.InferenceSession(str(TINY_COSYVOICE2_REF / "speech_tokenizer_v2.onnx"), providers=["CPUExecutionProvider"])
    assert not np.array_equal(codes, v2.run(None, {"feats": feats, "feats_length": np.array([401], np.int32)})[0])


def test_the_tokenizer_cases_hold_the_cosyvoice3_special_tokens_and_presets() -> None:
    cases = json.loads((TINY_COSYVOICE3_REF / "tokenizer_cases.json").read_text(encoding="utf-8"))
    added = {t["content"]: t["id"] for t in cases["tokenizer"]["added_tokens"]}
    assert (added["<|endofprompt|>"], added["<|endofsystem|>"], added["[ǜ]"]) == (END_OF_PROMPT, END_OF_SYSTEM, 151923)
    assert (cases["additional_special_tokens_listed"], cases["additional_special_tokens_new"]) == (280, 278)
    presets = cases["instruct_presets"]
    assert len(presets) == 26 and all(p["text"].startswith("You are a helpful assistant.") for p in presets)
    assert all(p["ids"][-1] == END_OF_PROMPT for p in presets)
    by_name = {c["name"]: c for c in cases["cases"]}
    markup = by_name["markup_skips_frontend"]  # <|...|> skips normalization and splitting
    assert markup["skips_frontend"] and markup["normalized_sentences"] == [markup["text"]]
    assert len(by_name["long_en_split"]["normalized_sentences"]) > 1
    assert by_name["system_prefix_only"]["raw_ids"][-1] == END_OF_PROMPT


def mode_cases() -> list[tuple[str, dict[str, np.ndarray], dict[str, Any]]]:
    meta = fixture_meta()
    rows = []
    for mode in ("zero_shot", "cross_lingual", "instruct2"):
        arrays = load(mode)
        for i, case in enumerate(meta[mode]):
            prefix = f"case{i}_"
            rows.append((mode, {k.removeprefix(prefix): v for k, v in arrays.items() if k.startswith(prefix)}, case))
    return rows


def test_every_llm_text_carries_the_end_of_prompt_marker_and_the_prefill_has_its_documented_length() -> None:
    for mode, case, _ in mode_cases():
        text = [*case.get("mi_prompt_text", []), *case["mi_text"]]
        assert END_OF_PROMPT in text, mode
        prompt_tokens = len(case.get("mi_llm_prompt_speech_token", []))
        assert case["llm_prefill_input"].shape[0] == 1 + len(text) + 1 + prompt_tokens
        assert case["llm_ignore_eos"].tolist() == [step < 2 * len(case["mi_text"]) for step in range(len(case["llm_ignore_eos"]))]


def test_the_flow_gets_the_silence_filtered_tokens() -> None:
    shortened = 0
    for _, case, meta in mode_cases():
        assert case["flow_tokens"].tolist() == silence_filtered(case["forced_tokens"].tolist())
        shortened += len(case["forced_tokens"]) - len(case["flow_tokens"])
        frames = case["flow_solver_out"].shape[1]
        assert frames == 2 * (len(case["mi_flow_prompt_speech_token"]) + len(case["flow_tokens"]))
        assert case["hift_speech"].shape[0] == FRAME * 2 * len(case["flow_tokens"]) == FRAME * meta["tts_mel_frames"]
    assert shortened == 3  # zero-shot case 1: a run of 8 silent tokens keeps 5


def test_the_llm_arrays_agree_with_each_other() -> None:
    for _, case, _ in mode_cases():
        assert np.abs(case["llm_step_hidden"] - case["llm_nocache_hidden"]).max() < 1e-5
        logp = case["llm_logp_rows"]
        assert logp.shape[1] == 6761 and np.allclose(np.exp(logp).sum(axis=1), 1, atol=1e-4)
        assert np.allclose(logp[:, EOS], case["llm_logp_eos"][case["llm_logp_row_index"]])


def test_the_recorded_stream_schedules_follow_the_documented_rule() -> None:
    meta = fixture_meta()
    for run in meta["stream"].values():
        s = run["schedule"]
        recorded = list(zip(s["chunk_offset"], s["chunk_token_len"], s["chunk_finalize"], strict=True))
        assert recorded == official_schedule(run["prompt_tokens"], run["forced_tokens"])
        assert s["chunk_flow_streaming"] == [not final for final in s["chunk_finalize"]]
    hop = meta["official_defects"]["token_hop_len_not_reset"]
    prompt_tokens = meta["prompts"]["zh_16k"]["trimmed_tokens"]
    first = [given for _, given, _ in official_schedule(prompt_tokens, hop["forced_tokens"])]
    later = [given for _, given, _ in official_schedule(prompt_tokens, hop["forced_tokens"], first_hop=100)]
    assert (hop["first_request_token2wav_token_lens"], hop["second_request_token2wav_token_lens"]) == (first, later)


def test_the_recorded_chunk_sizes_follow_the_causal_vocoder_over_the_mel_history() -> None:
    for run in fixture_meta()["stream"].values():
        s = run["schedule"]
        history, returned = 0, 0
        for k, (offset, given, final) in enumerate(
            zip(s["chunk_offset"], s["chunk_token_len"], s["chunk_finalize"], strict=True)
        ):
            solved = given if final else given - 3  # non-final calls hold the last 3 tokens back as look-ahead
            assert s["chunk_flow_frames"][k] == 2 * (run["prompt_tokens"] + solved)
            assert s["chunk_new_mel_frames"][k] == 2 * (solved - offset)
            history += s["chunk_new_mel_frames"][k]
            assert s["chunk_hift_mel_frames"][k] == history  # HiFT re-runs over every frame so far
            assert s["chunk_hift_out_samples"][k] == FRAME * (history - (0 if final else HIFT_HELD_BACK))
            assert s["chunk_yielded_samples"][k] == s["chunk_hift_out_samples"][k] - returned
            returned = s["chunk_hift_out_samples"][k]
        assert all(r["earlier_samples_max_abs"] < 1e-5 for r in run["hift_recompute"])


def test_the_stream_arrays_agree_with_their_documented_relations() -> None:
    stream, hift = load("stream"), load("hift")
    last = int(stream["zs_chunk_offset"].shape[0]) - 1
    prompt_frames = stream["zs_mi_prompt_speech_feat"].shape[0]
    offset = int(stream["zs_chunk_offset"][last])
    final_mel = stream[f"zs_k{last}_flow_solver_out"][:, prompt_frames + 2 * offset :]
    assert np.array_equal(final_mel, stream[f"zs_k{last}_flow_new_mel"])
    audio = np.concatenate([stream[f"zs_k{k}_yielded"] for k in range(last + 1)])
    assert audio.shape[0] == stream[f"zs_k{last}_hift_source"].shape[0]
    assert stream[f"zs_k{last}_hift_f0"].dtype == np.float64 and hift["case0_f0"].dtype == np.float64
    assert hift["case2_speech"].shape[0] == FRAME * (hift["case2_mel"].shape[1] - HIFT_HELD_BACK)


def test_the_flow_noise_is_the_cosyvoice2_buffer_and_the_stored_prefixes_cover_every_call() -> None:
    noise, meta = load("noise"), fixture_meta()["noise"]
    with np.load(TINY_COSYVOICE2_REF / "flow_noise.npz") as v2:
        shared = min(v2["rand_noise"].shape[1], noise["flow_rand_noise"].shape[1])
        assert np.array_equal(noise["flow_rand_noise"][:, :shared], v2["rand_noise"][:, :shared])
    assert noise["flow_rand_noise"].shape == (80, meta["stored_flow_frames"])
    assert noise["hift_sine_waves"].shape == (meta["stored_hift_samples"], 9)
    assert noise["hift_sine_waves"].min() >= 0 and noise["hift_sine_waves"].max() < 1  # torch.rand: uniform
    assert noise["hift_rand_ini"][0] == 0


def test_the_noise_buffers_depend_only_on_how_the_yaml_is_loaded() -> None:
    """shapes.json built the modules without loading any weights: the same digests as the fixture run's model."""
    shapes = json.loads((TINY_COSYVOICE3_REF / "shapes.json").read_text(encoding="utf-8"))
    assert shapes["_noise_buffers"] == fixture_meta()["noise"]["digests"]
    full = json.loads((TINY_COSYVOICE3_REF.parent / "fun-cosyvoice3-0.5b.shapes.json").read_text(encoding="utf-8"))
    ours, theirs = shapes["_noise_buffers"], full["_noise_buffers"]
    assert ours["flow_rand_noise"] == theirs["flow_rand_noise"]  # seeded right before it is drawn
    assert ours["hift_sine_waves"]["sha256"] != theirs["hift_sine_waves"]["sha256"]  # depends on the sizes before it


def test_the_official_behaviours_were_confirmed() -> None:
    checks = fixture_meta()["official_defects"]
    assert checks["min_len_masks_sos_not_eos"]["taken_with_ignore_eos"] == EOS
    assert all(check["confirmed"] for check in checks.values() if isinstance(check, dict))
    assert fixture_meta()["hift_rand_ini_check"]["confirmed_no_effect"]


def test_the_readme_tables_are_generated_from_the_committed_fixtures() -> None:
    readme = (TINY_COSYVOICE3_REF / "README.md").read_text(encoding="utf-8")
    for name, block in readme_tables.blocks(TINY_COSYVOICE3_REF, fixture_meta()).items():
        assert f"<!-- generated:{name} -->\n{block}\n<!-- /generated:{name} -->" in readme, f"README block {name} is stale"


@pytest.mark.export
def test_the_tiny_checkpoint_matches_its_shapes_table() -> None:
    torch = pytest.importorskip("torch")
    shapes = json.loads((TINY_COSYVOICE3_REF / "shapes.json").read_text(encoding="utf-8"))
    for name in ("llm.pt", "flow.pt", "hift.pt"):
        state = torch.load(TINY_COSYVOICE3_REF / name, weights_only=True)
        assert ck.describe(state) == shapes[name], name
        assert all(bool(v.isfinite().all()) for v in state.values()), name
