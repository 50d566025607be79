"""The manifest schema shared with export/: graph entries, capabilities, and the checks a manifest must pass."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from service.bundle.constants import CosyVoice2Constants, ModelConstants
from service.bundle.layout import (
    FAMILY_V1,
    FAMILY_V2,
    FLOAT_SUFFIX,
    FORMAT_VERSION,
    GRAPH_IO,
    GROUP_CORE,
    GROUP_FLOAT,
    GROUP_NATIVE,
    GROUP_PROMPT,
    NATIVE_GRAPHS,
    NATIVE_SUFFIX,
    FamilyLayout,
    family_layout,
)
from service.errors import BundleError


@dataclass(frozen=True)
class GraphEntry:
    """One ONNX graph of the bundle."""

    file: str
    sha256: str
    precision: str  # "fp32", "int8", "int4" (4-bit weight-only MatMulNBits) or "int8-weights" (a float twin)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    opset: int = 13
    group: str = GROUP_CORE  # "core" (written by our exporter) or "prompt" (copied from the checkpoint)


@dataclass(frozen=True)
class Capabilities:
    """What a bundle can voice. The defaults are what a manifest without this key (an older bundle) means."""

    builtin_speakers: bool = True  # speakers.json lists speakers (SFT and instruct need one)
    prompt_analysis: bool = False  # the prompt group is present: voices from prompt audio (zero-shot, cross-lingual)
    instruct: bool = False  # trained for instruct text in front of the LLM text (CosyVoice-300M-Instruct)
    instruct2: bool = False  # an instruction in front of the text with a cloned voice (CosyVoice2 inference_instruct2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Capabilities:
        """Parse `manifest.capabilities`; absent keys take the defaults above, unknown keys are refused."""
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise BundleError(f"manifest capabilities has unknown key(s) {', '.join(unknown)}")
        legacy = cls()
        return cls(**{f.name: _flag(data, f.name, getattr(legacy, f.name)) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class Manifest:
    """The bundle's manifest.json."""

    format_version: int
    model: str
    precision: str
    constants: ModelConstants
    graphs: dict[str, GraphEntry]
    source_files: dict[str, str] = field(default_factory=dict)  # checkpoint file name -> sha256
    files: dict[str, str] = field(default_factory=dict)  # bundle file (non-graph) -> sha256
    exporter: dict[str, str] = field(default_factory=dict)  # tool versions, random_init, seed
    random_weights: bool = False  # the weights were not trained: the audio is noise
    test_model: bool = False  # a miniature model for tests and CI, not for speech
    description: str = ""  # one sentence for people: what this model is
    capabilities: Capabilities = field(default_factory=Capabilities)
    family: str = FAMILY_V1  # the model family (its graphs and engine); absent from v1 manifests
    cosyvoice2: CosyVoice2Constants | None = None  # CosyVoice2 only

    @property
    def layout(self) -> FamilyLayout:
        return family_layout(self.family)

    def graphs_in(self, group: str) -> dict[str, GraphEntry]:
        """The graphs of one group ("core", "prompt" or "float"), in manifest order."""
        return {n: g for n, g in self.graphs.items() if g.group == group}

    @property
    def warning(self) -> str | None:
        """What to tell a user of a model whose audio is noise (None for a trained model)."""
        if not (self.random_weights or self.test_model):
            return None
        kind = "a test model" if self.test_model else "a benchmark model"
        return (
            f"{self.model} is {kind} with random weights: its audio is noise, not speech. "
            "Export and serve an official CosyVoice checkpoint for real speech (README: Serving the real model)."
        )

    def to_json(self) -> str:
        """Serialize deterministically (sorted keys, no timestamps) so exports are reproducible.

        Keys added for CosyVoice2 are left out at their v1 values, so a v1 manifest keeps its bytes.
        """
        data = dataclasses.asdict(self)
        if data["family"] == FAMILY_V1:
            del data["family"]
        if data["cosyvoice2"] is None:
            del data["cosyvoice2"]
        if not data["capabilities"]["instruct2"]:
            del data["capabilities"]["instruct2"]
        return json.dumps(data, ensure_ascii=False, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """Parse and validate a manifest dict; raises BundleError naming what is wrong."""
        try:
            version = int(data["format_version"])
            if version != FORMAT_VERSION:
                raise BundleError(f"manifest format_version {version} is not supported (expected {FORMAT_VERSION})")
            consts = dict(data["constants"])
            consts["upsample_rates"] = tuple(consts.get("upsample_rates", (8, 8)))
            graphs = {
                name: GraphEntry(**{**g, "inputs": tuple(g["inputs"]), "outputs": tuple(g["outputs"])})
                for name, g in data["graphs"].items()
            }
            manifest = cls(
                format_version=version,
                model=str(data["model"]),
                precision=str(data["precision"]),
                constants=ModelConstants(**consts),
                graphs=graphs,
                source_files=dict(data.get("source_files", {})),
                files=dict(data.get("files", {})),
                exporter=dict(data.get("exporter", {})),
                # bundles written before these keys existed say it in exporter.random_init
                random_weights=_flag(data, "random_weights", data.get("exporter", {}).get("random_init") == "true"),
                test_model=_flag(data, "test_model"),
                description=str(data.get("description", "")),
                capabilities=Capabilities.from_dict(dict(data.get("capabilities", {}))),
                family=str(data.get("family", FAMILY_V1)),
                cosyvoice2=CosyVoice2Constants(**data["cosyvoice2"]) if data.get("cosyvoice2") is not None else None,
            )
            family_layout(manifest.family)
            if (manifest.family == FAMILY_V2) != (manifest.cosyvoice2 is not None):
                raise BundleError("manifest key 'cosyvoice2' must be present exactly when family is 'cosyvoice2'")
        except BundleError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(f"manifest is malformed: {type(e).__name__}: {e}") from e
        _check_groups(manifest)
        return manifest


def _check_groups(manifest: Manifest) -> None:
    """Graph groups agree with the table above and with the declared capabilities."""
    prompt_graphs = manifest.layout.prompt_graphs
    for name, g in manifest.graphs.items():
        want = _group_of(name, prompt_graphs)
        if g.group != want:
            raise BundleError(f"manifest graph {name!r} is in group {g.group!r}, expected {want!r}")
        suffix = {GROUP_FLOAT: FLOAT_SUFFIX, GROUP_NATIVE: NATIVE_SUFFIX}.get(want)
        core = manifest.graphs.get(name.removesuffix(suffix)) if suffix else None
        if suffix and (core is None or (g.inputs, g.outputs) != (core.inputs, core.outputs)):
            raise BundleError(f"manifest graph {name!r} must have the inputs and outputs of its core graph")
        if want == GROUP_NATIVE and core is not None and g.precision != core.precision:
            raise BundleError(f"manifest graph {name!r} must have the precision of its core graph")
    caps, prompt = manifest.capabilities, manifest.graphs_in(GROUP_PROMPT)
    if caps.prompt_analysis:
        missing = [n for n in prompt_graphs if n not in prompt]
        if missing:
            raise BundleError(f"manifest declares prompt_analysis but lists no graph for {', '.join(missing)}")
        for name, (_, inputs, outputs) in prompt_graphs.items():
            if (prompt[name].inputs, prompt[name].outputs) != (inputs, outputs):
                raise BundleError(
                    f"manifest graph {name!r} has inputs {list(prompt[name].inputs)} / outputs "
                    f"{list(prompt[name].outputs)}, expected {list(inputs)} / {list(outputs)}"
                )
    elif prompt:
        raise BundleError(f"manifest lists prompt graphs ({', '.join(prompt)}) but does not declare prompt_analysis")
    if caps.instruct and not caps.builtin_speakers:
        raise BundleError("manifest declares instruct without builtin_speakers (instruct voices a built-in speaker)")
    if caps.instruct2 and not caps.prompt_analysis:
        raise BundleError("manifest declares instruct2 without prompt_analysis (instruct2 voices a prompt recording)")
    if not (caps.builtin_speakers or caps.prompt_analysis):
        raise BundleError("manifest declares neither builtin_speakers nor prompt_analysis: the model has no voice")


def _group_of(name: str, prompt_graphs: Any) -> str:
    if name in prompt_graphs:
        return GROUP_PROMPT
    if name.endswith(FLOAT_SUFFIX) and name.removesuffix(FLOAT_SUFFIX) in GRAPH_IO:
        return GROUP_FLOAT
    if name.endswith(NATIVE_SUFFIX) and name.removesuffix(NATIVE_SUFFIX) in NATIVE_GRAPHS:
        return GROUP_NATIVE
    return GROUP_CORE


def _flag(data: dict[str, Any], key: str, default: bool = False) -> bool:
    """A boolean manifest key (absent = `default`); anything but true/false is a malformed manifest."""
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise BundleError(f"manifest key {key!r} must be true or false, got {value!r}")
    return value
