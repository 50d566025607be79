"""What a checkpoint can voice (built-in speakers, prompt analysis, instruct), decided before the slow export steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from export import checkpoint, prompt_models
from export.onnx_io import ExportError
from export.prompt_models import PromptModel
from service.bundle import Capabilities


@dataclass(frozen=True)
class VoicePlan:
    """The speakers and prompt models a bundle will carry, and the capabilities its manifest declares."""

    speakers: dict[str, np.ndarray]
    prompt_models: dict[str, PromptModel]
    instruct: bool
    instruct2: bool = False  # CosyVoice2: instructions with a cloned voice (needs the prompt models)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            builtin_speakers=bool(self.speakers),
            prompt_analysis=bool(self.prompt_models),
            instruct=self.instruct,
            instruct2=self.instruct2 and bool(self.prompt_models),
        )

    def prompt_source_hashes(self) -> dict[str, str]:
        """Checkpoint file name -> sha256 of the prompt models (for manifest.source_files)."""
        return {m.source.name: m.entry.sha256 for m in self.prompt_models.values()}


def load_speakers(model_dir: Path, embed_dim: int, *, random_init: bool, seed: int) -> dict[str, np.ndarray]:
    """spk2info.pt's speakers ({} when the file is absent or empty), or seeded random ones for --random-init."""
    if random_init:
        return checkpoint.random_speakers(embed_dim, seed)
    path = model_dir / checkpoint.SPEAKERS_FILE
    return checkpoint.read_speakers(path, embed_dim) if path.is_file() else {}


def plan_voices(
    model_dir: Path,
    embed_dim: int,
    *,
    random_init: bool = False,
    seed: int = 0,
    instruct: bool = False,
    with_prompt_models: bool = True,
    log: Callable[[str], None] = print,
    prompt_table: prompt_models.PromptTable,
) -> VoicePlan:
    """Read speakers, check prompt models, and refuse a bundle that could voice nothing (ExportError, one line).

    `prompt_table` names the family's prompt model files (its contract's PROMPT_GRAPHS).
    """
    speakers = load_speakers(model_dir, embed_dim, random_init=random_init, seed=seed)
    models = prompt_models.find(model_dir, prompt_table) if with_prompt_models else {}
    files = [file for file, _, _ in prompt_table.values()]
    if not with_prompt_models and prompt_models.present(model_dir, prompt_table):
        log(f"note: --no-prompt-models: {'/'.join(files)} left out, the bundle cannot clone voices")
    if not speakers and not models:
        raise ExportError(
            f"{model_dir}: no built-in speakers ({checkpoint.SPEAKERS_FILE} missing or empty) and no prompt models "
            f"({' + '.join(files)}): the bundle could not voice anything"
        )
    if instruct and not speakers:
        raise ExportError(
            f"{model_dir}: instruct needs built-in speakers ({checkpoint.SPEAKERS_FILE} missing or empty): "
            "the v1 instruct path voices a built-in speaker"
        )
    if not speakers:
        log(f"note: no built-in speakers ({checkpoint.SPEAKERS_FILE} missing or empty): the bundle voices prompts only")
    return VoicePlan(speakers, models, instruct)
