"""The CosyVoice2 reference builders (scripts/cv2_reference) reproduce what tests/reference/tiny-cosyvoice2 holds."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from conftest import TINY_COSYVOICE2_REF
from cv2_reference import checkpoint as ck
from cv2_reference import readme_tables
from cv2_reference.environment import git_object_id, git_tree_id
from cv2_reference.qwen_tokenizer import QWEN2_FILE_SHA256, byte_to_unicode, vocab_and_merges
from cv2_reference.standins import write_standins

from service.bundle import sha256_file

BLANK = TINY_COSYVOICE2_REF / "CosyVoice-BlankEN"
OFFICIAL_YAML_BLOB = "8a4db63b1e3a9be36d001df61109074f002813a3"  # examples/libritts/cosyvoice2/conf/cosyvoice2.yaml at ace7c47


def test_the_tokenizer_files_are_qwen2s_and_rebuild_from_their_ranks() -> None:
    vocab_text = (BLANK / "vocab.json").read_text(encoding="utf-8")
    byte_of = {char: byte for byte, char in byte_to_unicode().items()}
    ranks = {bytes(byte_of[c] for c in token): rank for token, rank in json.loads(vocab_text).items()}
    assert len(ranks) == 151643
    rebuilt_vocab, rebuilt_merges = vocab_and_merges(ranks)
    assert rebuilt_vocab == vocab_text
    assert rebuilt_merges == (BLANK / "merges.txt").read_text(encoding="utf-8")
    assert {name: sha256_file(BLANK / name) for name in QWEN2_FILE_SHA256} == QWEN2_FILE_SHA256


def test_full_size_values_turn_the_tiny_yaml_back_into_the_official_file() -> None:
    official, changes = ck.resized_yaml((TINY_COSYVOICE2_REF / "cosyvoice2.yaml").read_text(encoding="utf-8"), ck.FULL)
    assert git_object_id("blob", official.encode()).hex() == OFFICIAL_YAML_BLOB
    assert [label for label, _, _ in changes] == [label for label, *_ in ck.YAML_EDITS]
    tiny, _ = ck.resized_yaml(official, ck.SIZES["tiny"])
    assert tiny == (TINY_COSYVOICE2_REF / "cosyvoice2.yaml").read_text(encoding="utf-8")


def test_the_qwen2_config_is_the_tiny_size() -> None:
    assert json.loads((BLANK / "config.json").read_text(encoding="utf-8")) == ck.qwen2_config(ck.SIZES["tiny"])


def test_the_stand_ins_rebuild_byte_for_byte(tmp_path: Path) -> None:
    write_standins(tmp_path, 0)
    for name in ("campplus.onnx", "speech_tokenizer_v2.onnx"):
        assert (tmp_path / name).read_bytes() == (TINY_COSYVOICE2_REF / name).read_bytes(), name


def test_the_stand_ins_have_the_released_signatures_and_depend_on_their_input() -> None:
    campplus = ort.InferenceSession(str(TINY_COSYVOICE2_REF / "campplus.onnx"), providers=["CPUExecutionProvider"])
    assert [(i.name, i.type, i.shape) for i in campplus.get_inputs()] == [("input", "tensor(float)", ["B", "T", 80])]
    assert [(o.name, o.type, o.shape) for o in campplus.get_outputs()] == [("output", "tensor(float)", ["B", 192])]
    tokenizer = ort.InferenceSession(str(TINY_COSYVOICE2_REF / "speech_tokenizer_v2.onnx"), providers=["CPUExecutionProvider"])
    assert [(i.name, i.type) for i in tokenizer.get_inputs()] == [("feats", "tensor(float)"), ("feats_length", "tensor(int32)")]
    assert [(o.name, o.type) for o in tokenizer.get_outputs()] == [("indices", "tensor(int64)")]
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((1, 128, 401)).astype(np.float32)
    codes = tokenizer.run(None, {"feats": feats, "feats_length": np.array([401], np.int32)})[0]
    assert codes.shape == (1, 101) and codes.min() >= 0 and codes.max() < 6561 and len(set(codes[0].tolist())) > 50
    shorter = tokenizer.run(None, {"feats": feats, "feats_length": np.array([300], np.int32)})[0]
    assert np.array_equal(codes[0, :70], shorter[0, :70]) and not np.array_equal(codes[0, 80:], shorter[0, 80:])
    a, b = (campplus.run(None, {"input": rng.standard_normal((1, 200, 80)).astype(np.float32)})[0] for _ in range(2))
    assert a.shape == (1, 192) and not np.allclose(a, b)


def test_git_tree_id_is_gits(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("print('a')\n")
    (tmp_path / "pkg" / "sub" / "b.txt").write_bytes(b"\x00\x01binary")
    (tmp_path / "pkg" / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "pkg" / "run.sh").chmod(0o755)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "pkg"], check=True)
    tree = subprocess.run([*git, "write-tree", "--prefix=pkg/"], check=True, capture_output=True, text=True).stdout.strip()
    (tmp_path / "pkg" / "__pycache__").mkdir()  # what importing the package leaves behind is not part of the tree
    (tmp_path / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"cache")
    assert git_tree_id(tmp_path / "pkg") == tree


@pytest.mark.export
def test_pooled_weights_keep_scale_and_stay_small(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    template = {
        "proj.weight": torch.randn(512, 512) * 0.02,
        "proj2.weight": torch.randn(512, 512) * 0.02,
        "embed.weight": torch.randn(6561, 64),
        "norm.weight": torch.ones(64),
        "norm.bias": torch.zeros(64),
        "small.weight": torch.randn(8, 8) * 0.3,
    }
    state = ck.random_state_dict(template, np.random.RandomState(0))
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in template.items()}
    assert not torch.equal(state["proj.weight"], state["proj2.weight"])
    assert 0.01 < float(state["proj.weight"].std()) < 0.04 and 0.5 < float(state["embed.weight"].std()) < 2
    assert float((state["norm.weight"] - 1).abs().max()) <= 0.1 and 0 < float(state["norm.bias"].abs().max()) <= 0.1
    path = tmp_path / "state.pt"
    torch.save(state, path)
    assert path.stat().st_size < sum(v.numel() for v in template.values()) * 4 / 4
    loaded = torch.load(path, weights_only=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="uninitialized"):
        ck.random_state_dict({"w": torch.full((64, 64), 3e30)}, np.random.RandomState(0))


@pytest.mark.export
def test_the_tiny_checkpoint_matches_its_shapes_table() -> None:
    torch = pytest.importorskip("torch")
    shapes = json.loads((TINY_COSYVOICE2_REF / "shapes.json").read_text(encoding="utf-8"))
    for name in ("llm.pt", "flow.pt", "hift.pt"):
        state = torch.load(TINY_COSYVOICE2_REF / name, weights_only=True)
        assert ck.describe(state) == shapes[name], name
        assert all(bool(v.isfinite().all()) for v in state.values()), name
    llm = torch.load(TINY_COSYVOICE2_REF / "llm.pt", weights_only=True)
    tied = shapes["_tied"]["llm.pt"]
    assert all(torch.equal(llm[key], llm[target]) for key, target in tied.items())


def official_schedule(prompt_tokens: int, n_tokens: int, first_hop: int = 25) -> list[tuple[int, int, bool]]:
    """(token_offset, tokens given, finalize) of each token2wav call, as README's "Streaming" section states the rule."""
    pad = math.ceil(prompt_tokens / 25) * 25 - prompt_tokens
    hop, offset, calls = first_hop, 0, []
    while n_tokens - offset >= (this := hop + pad if offset == 0 else hop) + 3:
        calls.append((offset, offset + this + 3, False))
        offset, hop = offset + this, min(100, hop * 2)
    return [*calls, (offset, n_tokens, True)]


def fixture_meta() -> dict[str, Any]:
    return json.loads((TINY_COSYVOICE2_REF / "fixtures_meta.json").read_text(encoding="utf-8"))


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


def test_the_recorded_chunk_sizes_follow_token2wav() -> None:
    meta = fixture_meta()
    for run in meta["stream"].values():
        s = run["schedule"]
        prompt_frames = 2 * run["prompt_tokens"]
        for k, (offset, given, final) in enumerate(
            zip(s["chunk_offset"], s["chunk_token_len"], s["chunk_finalize"], strict=True)
        ):
            solved = given if final else given - 3  # non-final calls hold the last 3 tokens back as look-ahead
            assert s["chunk_flow_frames"][k] == prompt_frames + 2 * solved
            assert s["chunk_new_mel_frames"][k] == 2 * (solved - offset)
            assert s["chunk_hift_mel_frames"][k] == s["chunk_new_mel_frames"][k] + (8 if k else 0)
            assert s["chunk_cache_source_samples"][k] == (3840 if k else 0)
            assert s["chunk_yielded_samples"][k] == 480 * s["chunk_hift_mel_frames"][k] - (0 if final else 3840)


def test_the_fixture_arrays_agree_with_their_documented_relations() -> None:
    with np.load(TINY_COSYVOICE2_REF / "stream.npz") as stream, np.load(TINY_COSYVOICE2_REF / "flow_noise.npz") as noise:
        assert noise["rand_noise"].shape == (80, fixture_meta()["flow_noise"]["stored_frames"])
        mel = stream["zs_k1_hift_mel"]
        assert np.array_equal(mel[:, :8], stream["zs_k0_hift_mel"][:, -8:])  # the 8-frame mel cache
        assert np.array_equal(mel[:, 8:], stream["zs_k1_flow_new_mel"])
        assert np.array_equal(stream["zs_k1_hift_source"][:3840], stream["zs_k0_hift_source"][-3840:])  # cache_source
    with np.load(TINY_COSYVOICE2_REF / "zero_shot.npz") as z:
        hidden, nocache = z["case0_llm_step_hidden"], z["case0_llm_nocache_hidden"]
        assert np.abs(hidden - nocache).max() < 1e-5
        logp = z["case0_llm_logp_rows"]
        assert np.allclose(np.exp(logp).sum(axis=1), 1, atol=1e-4)
        assert np.allclose(logp[:, 6561], z["case0_llm_logp_eos"][z["case0_llm_logp_row_index"]])


def test_the_readme_tables_are_generated_from_the_committed_fixtures() -> None:
    readme = (TINY_COSYVOICE2_REF / "README.md").read_text(encoding="utf-8")
    for name, block in readme_tables.blocks(TINY_COSYVOICE2_REF, fixture_meta()).items():
        assert f"<!-- generated:{name} -->\n{block}\n<!-- /generated:{name} -->" in readme, f"README block {name} is stale"
