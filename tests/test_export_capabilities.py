"""Export of the three v1 checkpoint kinds: optional speakers, the prompt models, instruct, and their refusals."""

from __future__ import annotations

import subprocess
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper
from test_export_cli import CHECKPOINT_FILES, PROMPT_FILES, copy_checkpoint, run_export

from export.checkpoint import is_instruct_dir, model_name_for
from service.bundle import Capabilities, ModelBundle
from service.families.cosyvoice1.contract import PROMPT_GRAPH_NAMES

pytestmark = pytest.mark.export
WEIGHTS = ("cosyvoice.yaml", "llm.pt", "flow.pt", "hift.pt", "multilingual.tiktoken")


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def write_onnx(path: Path, inputs: list[str], outputs: list[str]) -> None:
    """A tiny valid ONNX graph (Identity per output) with the given input/output names."""
    values = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "T", 80]) for n in inputs]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "T", 80]) for n in outputs]
    nodes = [helper.make_node("Identity", [inputs[0]], [o]) for o in outputs]
    model = helper.make_model(helper.make_graph(nodes, "stand_in", values, outs), opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))


@pytest.mark.parametrize(
    ("dirname", "name", "instruct"),
    [
        ("CosyVoice-300M", "CosyVoice-300M", False),
        ("cosyvoice-300m-sft", "CosyVoice-300M-SFT", False),
        ("CosyVoice-300M-Instruct", "CosyVoice-300M-Instruct", True),
        ("my-checkpoint", "CosyVoice-300M-SFT", False),
        ("Other-Instruct", "CosyVoice-300M-SFT", True),
    ],
)
def test_model_name_and_instruct_follow_the_directory(tmp_path: Path, dirname: str, name: str, instruct: bool) -> None:
    (tmp_path / dirname).mkdir()
    assert model_name_for(tmp_path / dirname) == name
    assert is_instruct_dir(tmp_path / dirname) is instruct


def test_base_model_without_speakers_is_a_prompt_only_bundle(tmp_path: Path, ref_dir: Path) -> None:
    src = copy_checkpoint(ref_dir, tmp_path / "CosyVoice-300M", WEIGHTS + PROMPT_FILES)
    proc = run_export("--model-dir", src, "--out", tmp_path / "b")
    assert proc.returncode == 0, proc.stderr
    assert "no built-in speakers" in proc.stdout
    bundle = ModelBundle.load(tmp_path / "b", verify_hashes=True)
    assert bundle.manifest.model == "CosyVoice-300M"
    assert bundle.capabilities == Capabilities(builtin_speakers=False, prompt_analysis=True, instruct=False)
    assert bundle.speakers == {} and bundle.has_prompt_analysis
    assert "spk2info.pt" not in bundle.manifest.source_files and "campplus.onnx" in bundle.manifest.source_files


def test_instruct_directory_declares_instruct_and_names_the_model(tmp_path: Path, ref_dir: Path) -> None:
    src = copy_checkpoint(ref_dir, tmp_path / "CosyVoice-300M-Instruct", CHECKPOINT_FILES + PROMPT_FILES)
    proc = run_export("--model-dir", src, "--out", tmp_path / "b", "--quantize", "int4")
    assert proc.returncode == 0, proc.stderr
    bundle = ModelBundle.load(tmp_path / "b")
    assert bundle.manifest.model == "CosyVoice-300M-Instruct"
    assert bundle.capabilities == Capabilities(builtin_speakers=True, prompt_analysis=True, instruct=True)
    int4 = ModelBundle.load(tmp_path / "b-int4", verify_hashes=True)  # quantized twin: prompt group and capabilities kept
    assert int4.capabilities == bundle.capabilities and int4.manifest.model == "CosyVoice-300M-Instruct-int4"
    assert {n: int4.manifest.graphs[n] for n in PROMPT_GRAPH_NAMES} == {n: bundle.manifest.graphs[n] for n in PROMPT_GRAPH_NAMES}


def test_model_name_flag_overrides_the_directory(tmp_path: Path, ref_dir: Path) -> None:
    src = copy_checkpoint(ref_dir, tmp_path / "CosyVoice-300M-SFT", CHECKPOINT_FILES)
    proc = run_export("--model-dir", src, "--out", tmp_path / "b", "--model-name", "my-voice", "--instruct")
    assert proc.returncode == 0, proc.stderr
    bundle = ModelBundle.load(tmp_path / "b")
    assert bundle.manifest.model == "my-voice"
    assert bundle.capabilities == Capabilities(builtin_speakers=True, prompt_analysis=False, instruct=True)
    assert not any((tmp_path / "b" / f).exists() for f in PROMPT_FILES)


@pytest.mark.parametrize("present", PROMPT_FILES)
def test_one_prompt_model_alone_is_refused(tmp_path: Path, ref_dir: Path, present: str) -> None:
    src = copy_checkpoint(ref_dir, tmp_path / "ckpt", (*CHECKPOINT_FILES, present))
    proc = run_export("--model-dir", src, "--out", tmp_path / "b")
    missing = next(f for f in PROMPT_FILES if f != present)
    assert_one_line_error(proc, present, missing, "--no-prompt-models")
    assert not (tmp_path / "b").exists()


def test_no_prompt_models_flag_leaves_them_out(tmp_path: Path, ref_dir: Path) -> None:
    src = copy_checkpoint(ref_dir, tmp_path / "ckpt", (*CHECKPOINT_FILES, "campplus.onnx"))
    proc = run_export("--model-dir", src, "--out", tmp_path / "b", "--no-prompt-models")
    assert proc.returncode == 0, proc.stderr
    bundle = ModelBundle.load(tmp_path / "b")
    assert not bundle.has_prompt_analysis and "campplus.onnx" not in bundle.manifest.source_files


WRONG_IO = [("campplus.onnx", (["x"], ["y"])), ("speech_tokenizer_v1.onnx", (["feats"], ["indices"]))]


@pytest.mark.parametrize(("bad", "names"), WRONG_IO)
def test_prompt_model_with_wrong_io_names_is_one_clear_error(
    tmp_path: Path, ref_dir: Path, bad: str, names: tuple[list[str], list[str]]
) -> None:
    src = copy_checkpoint(ref_dir, tmp_path / "ckpt", CHECKPOINT_FILES + PROMPT_FILES)
    write_onnx(src / bad, *names)
    proc = run_export("--model-dir", src, "--out", tmp_path / "b")
    assert_one_line_error(proc, bad, "expected", repr(names[0][0]))
    assert not (tmp_path / "b").exists()


def test_prompt_model_that_is_not_onnx_is_one_clear_error(tmp_path: Path, ref_dir: Path) -> None:
    src = copy_checkpoint(ref_dir, tmp_path / "ckpt", CHECKPOINT_FILES + PROMPT_FILES)
    (src / "campplus.onnx").write_bytes(b"not onnx at all")
    proc = run_export("--model-dir", src, "--out", tmp_path / "b")
    assert_one_line_error(proc, "campplus.onnx", "ONNX")


def test_nothing_to_voice_is_refused(tmp_path: Path, ref_dir: Path) -> None:
    src = copy_checkpoint(ref_dir, tmp_path / "ckpt", WEIGHTS)
    proc = run_export("--model-dir", src, "--out", tmp_path / "b")
    assert_one_line_error(proc, "spk2info.pt", "campplus.onnx", "could not voice anything")


def test_instruct_without_speakers_is_refused(tmp_path: Path, ref_dir: Path) -> None:
    src = copy_checkpoint(ref_dir, tmp_path / "CosyVoice-300M-Instruct", WEIGHTS + PROMPT_FILES)
    proc = run_export("--model-dir", src, "--out", tmp_path / "b")
    assert_one_line_error(proc, "instruct", "spk2info.pt")
