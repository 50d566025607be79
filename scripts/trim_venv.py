"""Remove from a serving virtualenv what the service never loads (the container image runs this after pip install).

`python scripts/trim_venv.py /app/.venv` deletes pip and setuptools (nothing is installed at run time), OpenVINO's GPU
and NPU plugins, its model-format readers other than ONNX and OpenVINO IR, its GPU kernel-tuning table, C++ headers
and model-conversion tools, and its telemetry package: about 100 MB of the image. Standard library only; prints
what it removed and the megabytes freed. Paths that are absent are skipped, so it is safe to run twice.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

UNUSED = (
    "pip",
    "pip-*.dist-info",
    "setuptools",
    "setuptools-*.dist-info",
    "_distutils_hack",
    "distutils-precedence.pth",
    "openvino_telemetry",
    "openvino_telemetry-*.dist-info",
    "openvino/libs/libopenvino_intel_gpu_plugin.so",
    "openvino/libs/libopenvino_intel_npu_plugin.so",
    "openvino/libs/libopenvino_tensorflow_frontend.so*",
    "openvino/libs/libopenvino_tensorflow_lite_frontend.so*",
    "openvino/libs/libopenvino_paddle_frontend.so*",
    "openvino/libs/libopenvino_pytorch_frontend.so*",
    "openvino/libs/libopenvino_jax_frontend.so*",
    "openvino/libs/libopenvino_gguf_frontend.so*",
    "openvino/libs/cache.json",
    "openvino/include",
    "openvino/tools",
)


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise SystemExit(f"error: no site-packages under {venv}")
    return found[0]


def size(path: Path) -> int:
    if path.is_dir() and not path.is_symlink():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    return path.lstat().st_size


def trim(site: Path) -> int:
    """Delete the UNUSED paths under `site`; returns the bytes freed."""
    freed = 0
    for pattern in UNUSED:
        for path in sorted(site.glob(pattern)):
            freed += size(path)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            print(f"removed {path.relative_to(site)}")
    return freed


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/trim_venv.py VENV_DIR", file=sys.stderr)
        return 2
    freed = trim(site_packages(Path(argv[0])))
    print(f"freed {freed / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
