"""Read the official checkpoint files and load them strictly, with one clear message per failure."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from export.onnx_io import ExportError

REQUIRED_FILES = ("cosyvoice.yaml", "llm.pt", "flow.pt", "hift.pt")
# Built-in speakers: in -SFT and -Instruct; absent (or empty) in the zero-shot base CosyVoice-300M.
SPEAKERS_FILE = "spk2info.pt"
# The released v1 300M checkpoints; a directory with one of these names gives the bundle its model id.
OFFICIAL_MODEL_NAMES = ("CosyVoice-300M", "CosyVoice-300M-SFT", "CosyVoice-300M-Instruct")
DEFAULT_MODEL_NAME = "CosyVoice-300M-SFT"
# The official SFT speakers, in the order the released spk2info.pt lists them (used for --random-init).
OFFICIAL_SPEAKERS = ("中文女", "中文男", "日语男", "粤语女", "英文女", "英文男", "韩语女")
_MAX_LISTED = 6


class CheckpointError(ExportError):
    """A checkpoint file is missing, unreadable, or does not fit our modules."""


def missing_files(model_dir: Path, random_init: bool) -> list[str]:
    """Names of required checkpoint files absent from `model_dir`."""
    needed = ("cosyvoice.yaml",) if random_init else REQUIRED_FILES
    return [f for f in needed if not (model_dir / f).is_file()]


def model_name_for(model_dir: Path) -> str:
    """The official model id the directory is named after (any case), else DEFAULT_MODEL_NAME."""
    name = model_dir.resolve().name.lower()
    return next((m for m in OFFICIAL_MODEL_NAMES if m.lower() == name), DEFAULT_MODEL_NAME)


def is_instruct_dir(model_dir: Path) -> bool:
    """A directory named like CosyVoice-300M-Instruct (`*-Instruct`, any case) holds an instruct model."""
    return model_dir.resolve().name.lower().endswith("-instruct")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """torch.load a state dict on the CPU without unpickling arbitrary objects."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for corrupt or foreign files
        raise CheckpointError(f"{path}: cannot read as a torch state dict ({type(e).__name__}: {e})") from e
    if not isinstance(data, Mapping) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise CheckpointError(f"{path}: expected a state dict of tensors")
    return dict(data)


def _listing(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED])
    return shown + (f" (+{len(keys) - _MAX_LISTED} more)" if len(keys) > _MAX_LISTED else "")


def check_keys(module: torch.nn.Module, state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Raise CheckpointError naming the file and the keys if `state` does not fit `module` exactly."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = sorted(
        f"{k} {tuple(state[k].shape)} != {tuple(expected[k].shape)}"
        for k in set(expected) & set(state)
        if tuple(state[k].shape) != tuple(expected[k].shape)
    )
    problems = []
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatch: {_listing(mismatched)}")
    if problems:
        raise CheckpointError(f"{path}: does not match the configured architecture; " + "; ".join(problems))


def load_strict(
    module: torch.nn.Module,
    path: Path,
    normalize: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> None:
    """Load `path` into `module` with strict=True after optional key normalisation (e.g. weight-norm styles)."""
    state = read_state_dict(path)
    if normalize is not None:
        state = normalize(state)
    check_keys(module, state, path)
    module.load_state_dict(state, strict=True)


def read_speakers(path: Path, embed_dim: int) -> dict[str, np.ndarray]:
    """Convert spk2info.pt ({name: {'embedding': (1, dim)}}) into name -> float32 (dim,), order kept (may be empty)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read speaker table ({type(e).__name__}: {e})") from e
    if not isinstance(data, Mapping):
        raise CheckpointError(f"{path}: expected a dict speaker -> {{'embedding': tensor}}")
    out: dict[str, np.ndarray] = {}
    for name, info in data.items():
        emb = info.get("embedding") if isinstance(info, Mapping) else None
        if not isinstance(emb, torch.Tensor) or emb.numel() != embed_dim:
            raise CheckpointError(f"{path}: speaker {name!r} has no {embed_dim}-value 'embedding' tensor")
        out[str(name)] = emb.detach().float().reshape(-1).numpy().copy()
    return out


def random_speakers(embed_dim: int, seed: int) -> dict[str, np.ndarray]:
    """Seeded random x-vectors under the official speaker names (benchmark bundles only)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(embed_dim, generator=gen).numpy() for name in OFFICIAL_SPEAKERS}
