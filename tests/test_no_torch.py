"""The runtime works without torch: in a subprocess where `import torch` fails, import service and synthesize."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# Runs in a fresh interpreter. A meta-path finder placed first makes every torch import fail, as on a
# torch-free server image; then every module under service/ is imported and the tiny bundle speaks.
SCRIPT = r"""
import importlib, json, pkgutil, sys

BLOCKED = ("torch", "torchaudio", "torchvision")

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by test_no_torch)")
        return None

sys.meta_path.insert(0, NoTorch())
try:
    import torch  # noqa: F401
    raise SystemExit("torch import was not blocked")
except ModuleNotFoundError:
    pass

import service
names = sorted(m.name for m in pkgutil.walk_packages(service.__path__, "service.") if not m.name.endswith("__main__"))
for name in names:
    importlib.import_module(name)

from service.engine.types import SynthesisOptions
from service.families.cosyvoice1.engine import Synthesizer

synth = Synthesizer.load(sys.argv[1])
chunks = list(synth.synthesize([[15947, 1002, 13]], synth.speakers[0], SynthesisOptions(seed=0, stream=True)))
audio = [float(abs(c.audio).max()) for c in chunks if len(c.audio)]
print(json.dumps({
    "modules": names,
    "chunks": len(chunks),
    "samples": sum(len(c.audio) for c in chunks),
    "peak": max(audio),
    "final": chunks[-1].is_final,
    "torch_loaded": [m for m in sys.modules if m.split(".")[0] in BLOCKED],
}))
"""


def test_service_imports_and_synthesizes_without_torch(repo_root: Path, tiny_bundle: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_bundle)],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "service.families.cosyvoice1.engine" in result["modules"] and "service.bundle" in result["modules"]
    assert result["torch_loaded"] == []
    assert result["final"] is True and result["chunks"] >= 1
    assert result["samples"] > 0 and 0.0 < result["peak"] <= 0.99
