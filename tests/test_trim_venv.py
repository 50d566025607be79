"""scripts/trim_venv.py: the image's venv loses what the service never loads, and keeps what it does."""

from __future__ import annotations

from pathlib import Path

from trim_venv import main, trim


def _venv(root: Path) -> Path:
    site = root / "lib" / "python3.11" / "site-packages"
    for rel in (
        "pip/__init__.py",
        "pip-25.0.dist-info/METADATA",
        "openvino_telemetry/__init__.py",
        "openvino/libs/libopenvino_intel_gpu_plugin.so",
        "openvino/libs/libopenvino_tensorflow_frontend.so.2641",
        "openvino/libs/cache.json",
        "openvino/tools/ovc/__init__.py",
        # kept: the CPU plugin, the ONNX and IR readers, the runtime itself, other packages
        "openvino/libs/libopenvino_intel_cpu_plugin.so",
        "openvino/libs/libopenvino_onnx_frontend.so.2641",
        "openvino/libs/libopenvino_ir_frontend.so.2641",
        "openvino/libs/libopenvino.so.2641",
        "openvino/__init__.py",
        "onnxruntime/__init__.py",
        "numpy/__init__.py",
    ):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(b"x" * 1000)
    return site


def test_trim_removes_the_unused_parts_only(tmp_path: Path, capsys: object) -> None:
    site = _venv(tmp_path)
    assert main([str(tmp_path)]) == 0
    left = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())
    assert left == [
        "numpy/__init__.py",
        "onnxruntime/__init__.py",
        "openvino/__init__.py",
        "openvino/libs/libopenvino.so.2641",
        "openvino/libs/libopenvino_intel_cpu_plugin.so",
        "openvino/libs/libopenvino_ir_frontend.so.2641",
        "openvino/libs/libopenvino_onnx_frontend.so.2641",
    ]
    assert trim(site) == 0  # a second run finds nothing


def test_a_directory_without_a_venv_is_an_error(tmp_path: Path) -> None:
    try:
        main([str(tmp_path)])
    except SystemExit as e:
        assert "no site-packages" in str(e)
    else:
        raise AssertionError("expected an error")
