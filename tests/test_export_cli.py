"""export_onnx.py end to end on the tiny checkpoint: bundle contents, reproducibility, and every error case."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.bundle import MANIFEST_NAME, Capabilities, ModelBundle, sha256_file
from service.families.cosyvoice1.contract import GRAPH_NAMES, PROMPT_GRAPH_NAMES

pytestmark = pytest.mark.export
REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "export" / "export_onnx.py"


def run_export(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=600, cwd=REPO)


def _makefile_variable(name: str) -> str:
    match = re.search(rf"^{name}\s*:?=\s*(.+?)\s*$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert match, f"the Makefile sets {name}"
    return match.group(1)


def tiny_model_name() -> str:
    """The model id `make models/tiny` gives the committed bundle (TINY_NAME in the Makefile)."""
    return _makefile_variable("TINY_NAME")


def tiny_flags() -> list[str]:
    """The export flags of `make models/tiny` (TINY_FLAGS in the Makefile), so the re-export here is the same one."""
    return _makefile_variable("TINY_FLAGS").replace("$(TINY_NAME)", tiny_model_name()).split()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, ref_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "tiny"
    proc = run_export("--model-dir", ref_dir, "--out", out, *tiny_flags())
    assert proc.returncode == 0, proc.stderr
    assert "ok" in proc.stdout and "FAIL" not in proc.stdout
    return out


CHECKPOINT_FILES = ("cosyvoice.yaml", "llm.pt", "flow.pt", "hift.pt", "spk2info.pt", "multilingual.tiktoken")
PROMPT_FILES = ("campplus.onnx", "speech_tokenizer_v1.onnx")


def copy_checkpoint(ref_dir: Path, dst: Path, files: tuple[str, ...] = CHECKPOINT_FILES) -> Path:
    dst.mkdir()
    for name in files:
        shutil.copy(ref_dir / name, dst / name)
    return dst


def test_bundle_is_complete_and_loads(exported: Path, ref_dir: Path) -> None:
    bundle = ModelBundle.load(exported, verify_hashes=True)
    assert set(bundle.manifest.graphs) == set(GRAPH_NAMES) | set(PROMPT_GRAPH_NAMES)
    assert set(bundle.manifest.graphs_in("core")) == set(GRAPH_NAMES)
    assert all(g.opset == 13 for g in bundle.manifest.graphs.values())
    assert list(bundle.speakers)[:2] == ["中文女", "中文男"]
    assert bundle.constants.sample_rate == 22050 and bundle.constants.llm_num_layers == 2
    assert bundle.constants.llm_head_dim == 32 and bundle.constants.mel_overlap_len == 34
    assert set(bundle.manifest.source_files) == {"cosyvoice.yaml", "llm.pt", "flow.pt", "hift.pt", "spk2info.pt", *PROMPT_FILES}
    assert bundle.capabilities == Capabilities(builtin_speakers=True, prompt_analysis=True, instruct=True)
    for name in PROMPT_GRAPH_NAMES:  # copied verbatim
        path = bundle.prompt_model_path(name)
        assert path.read_bytes() == (ref_dir / path.name).read_bytes()
        assert bundle.manifest.source_files[path.name] == bundle.manifest.graphs[name].sha256


def test_export_reproduces_committed_tiny_bundle(exported: Path, tiny_bundle: Path) -> None:
    """`make models/tiny` is bit-for-bit reproducible: a fresh export equals the committed bundle."""
    fresh = sorted(p.name for p in exported.iterdir())
    assert fresh == sorted(p.name for p in tiny_bundle.iterdir())
    for name in fresh:
        assert sha256_file(exported / name) == sha256_file(tiny_bundle / name), name


def test_tiny_bundle_says_it_is_a_random_weight_test_model(tiny_bundle: Path) -> None:
    manifest = ModelBundle.load(tiny_bundle).manifest
    assert manifest.test_model and manifest.random_weights and manifest.model == tiny_model_name()
    assert "random" in manifest.description and manifest.warning and "noise" in manifest.warning


def test_random_init_needs_only_the_yaml(tmp_path: Path, ref_dir: Path) -> None:
    src = tmp_path / "cfg"
    src.mkdir()
    shutil.copy(ref_dir / "cosyvoice.yaml", src / "cosyvoice.yaml")
    proc = run_export("--model-dir", src, "--out", tmp_path / "b", "--random-init", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    bundle = ModelBundle.load(tmp_path / "b")
    assert bundle.manifest.exporter["random_init"] == "true"
    assert bundle.manifest.random_weights and not bundle.manifest.test_model and bundle.manifest.warning
    assert "中文女" in bundle.speakers


def test_int8_bundle_is_a_second_bundle(tmp_path: Path, ref_dir: Path) -> None:
    proc = run_export("--model-dir", ref_dir, "--out", tmp_path / "q", "--quantize", "int8")
    assert proc.returncode == 0, proc.stderr
    fp32, int8 = ModelBundle.load(tmp_path / "q"), ModelBundle.load(tmp_path / "q-int8", verify_hashes=True)
    assert fp32.manifest.precision == "fp32" and int8.manifest.precision == "int8"
    assert not fp32.manifest.random_weights and fp32.manifest.warning is None  # a checkpoint is trained unless marked
    quantized = {n for n, g in int8.manifest.graphs.items() if g.precision == "int8"}
    assert quantized == {
        "llm_encoder",
        "llm_embed",
        "llm_step",
        "llm_step_native",
        "flow_encoder",
        "flow_estimator",
        "flow_estimator_native",
    }
    assert int8.manifest.graphs["llm_step_native"].group == "native"  # the step's int8 products as our kernel
    assert int8.capabilities == fp32.capabilities and int8.has_prompt_analysis
    for name in PROMPT_GRAPH_NAMES:  # copied, not quantized
        assert int8.manifest.graphs[name] == fp32.manifest.graphs[name]
        assert sha256_file(int8.prompt_model_path(name)) == sha256_file(fp32.prompt_model_path(name))


@pytest.mark.parametrize("missing", ["llm.pt", "flow.pt", "cosyvoice.yaml"])
def test_missing_file_is_one_clear_line(tmp_path: Path, ref_dir: Path, missing: str) -> None:
    src = copy_checkpoint(ref_dir, tmp_path / "ckpt")
    (src / missing).unlink()
    proc = run_export("--model-dir", src, "--out", tmp_path / "b")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and missing in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "b").exists()


def _edit_state(path: Path, edit: str) -> None:
    import torch

    sd = torch.load(path, map_location="cpu", weights_only=True)
    if edit == "extra":
        sd["bogus.weight"] = torch.zeros(1)
    elif edit == "missing":
        del sd["llm_decoder.bias"]
    elif edit == "shape":
        sd["llm_decoder.bias"] = torch.zeros(7)
    torch.save(sd, path)


BAD_EDITS = [("extra", "bogus.weight"), ("missing", "llm_decoder.bias"), ("shape", "llm_decoder.bias")]


@pytest.mark.parametrize(("edit", "needle"), BAD_EDITS)
def test_bad_state_dict_names_file_and_keys(tmp_path: Path, ref_dir: Path, edit: str, needle: str) -> None:
    src = copy_checkpoint(ref_dir, tmp_path / "ckpt")
    _edit_state(src / "llm.pt", edit)
    proc = run_export("--model-dir", src, "--out", tmp_path / "b")
    assert proc.returncode == 2, proc.stderr
    assert "llm.pt" in proc.stderr and needle in proc.stderr and "Traceback" not in proc.stderr


def test_unmappable_yaml(tmp_path: Path, ref_dir: Path) -> None:
    src = copy_checkpoint(ref_dir, tmp_path / "ckpt")
    yaml_path = src / "cosyvoice.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("'rel_selfattn'", "'selfattn'"), encoding="utf-8")
    proc = run_export("--model-dir", src, "--out", tmp_path / "b")
    assert proc.returncode == 2 and "cosyvoice.yaml" in proc.stderr and "selfattention_layer_type" in proc.stderr


def test_corrupt_checkpoint_file(tmp_path: Path, ref_dir: Path) -> None:
    src = copy_checkpoint(ref_dir, tmp_path / "ckpt")
    (src / "flow.pt").write_bytes(b"not a torch file")
    proc = run_export("--model-dir", src, "--out", tmp_path / "b")
    assert proc.returncode == 2 and "flow.pt" in proc.stderr and "Traceback" not in proc.stderr


def test_failed_export_keeps_existing_bundle(tmp_path: Path, ref_dir: Path, exported: Path) -> None:
    out = tmp_path / "b"
    shutil.copytree(exported, out)
    before = sha256_file(out / MANIFEST_NAME)
    src = copy_checkpoint(ref_dir, tmp_path / "ckpt")
    _edit_state(src / "llm.pt", "shape")
    proc = run_export("--model-dir", src, "--out", out)
    assert proc.returncode == 2
    assert sha256_file(out / MANIFEST_NAME) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_manifest_is_deterministic_json(exported: Path) -> None:
    text = (exported / MANIFEST_NAME).read_text(encoding="utf-8")
    data = json.loads(text)
    assert json.dumps(data, ensure_ascii=False, indent=2, sort_keys=True) + "\n" == text
    assert data["format_version"] == 1
    assert not re.search(r"\d{4}-\d{2}-\d{2}|timestamp|created", text), "no wall-clock data: exports must be reproducible"
