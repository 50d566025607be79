"""The CosyVoice2 reference builders (scripts/cv2_reference) reproduce what tests/reference/tiny-cosyvoice2 holds."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from conftest import TINY_COSYVOICE2_REF
from cv2_reference import checkpoint as ck
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
