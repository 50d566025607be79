"""The manifest schema shared with export/: graph entries, capabilities, and the checks a manifest must pass."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from service.bundle.constants import ModelConstants
from service.bundle.layout import (
    FLOAT_SUFFIX,
    FORMAT_VERSION,
    GROUP_CORE,
    GROUP_FLOAT,
    GROUP_NATIVE,
    GROUP_PROMPT,
    LEGACY_FAMILY,
    NATIVE_SUFFIX,
)
from service.errors import BundleError


@dataclass(frozen=True)
class GraphEntry:
    """One ONNX graph of the bundle."""

    file: str
    sha256: str
    precision: str  # "fp32", "int8", "int4" (4-bit weight-only MatMulNBits), "int8-weights" (a float twin) or "bf16" (a
    # native twin of an fp32 graph whose kernels take bf16 products: the vocoder's)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    opset: int = 13
    group: str = GROUP_CORE  # "core" (written by our exporter) or "prompt" (copied from the checkpoint)
    # The graph's initializers in a file of their own (ONNX external data) that ONNX Runtime maps into memory instead of
    # copying: its name in the bundle and sha256 ("" when the weights are inside the .onnx file).
    weights: str = ""
    weights_sha256: str = ""


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
    family: str = LEGACY_FAMILY  # the model family (its graphs and engine); manifests before the key: LEGACY_FAMILY
    # The family's own constants, stored under the manifest key named like the family; the family reads them.
    family_section: dict[str, Any] = field(default_factory=dict)

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
        """Serialize deterministically (sorted keys, no timestamps) so exports are reproducible."""
        return self._json(legacy=False)

    def identity_json(self) -> str:
        """The manifest as its identity (audio cache keys) counts it: its JSON, without `family` for a LEGACY_FAMILY
        manifest, as those were written before every manifest named its family (their keys stay valid)."""
        return self._json(legacy=self.family == LEGACY_FAMILY)

    def _json(self, *, legacy: bool) -> str:
        data = dataclasses.asdict(self)
        section = data.pop("family_section")
        if section:
            data[self.family] = section
        if legacy:
            del data["family"]
        for graph in data["graphs"].values():  # inline weights: the keys are left out (the manifest's identity stays)
            if not graph["weights"]:
                del graph["weights"], graph["weights_sha256"]
        if not data["capabilities"]["instruct2"]:
            del data["capabilities"]["instruct2"]
        return json.dumps(data, ensure_ascii=False, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """Parse and validate a manifest dict; raises BundleError naming what is wrong."""
        try:
            family = str(data.get("family", LEGACY_FAMILY))
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
                family=family,
                family_section=_section(data, family),
            )
        except BundleError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(f"manifest is malformed: {type(e).__name__}: {e}") from e
        _check_groups(manifest)
        return manifest


_TWINS = {GROUP_FLOAT: FLOAT_SUFFIX, GROUP_NATIVE: NATIVE_SUFFIX}  # twin group -> the suffix of its graphs' names


def _check_groups(manifest: Manifest) -> None:
    """Graph groups are known, twins match their core graph, and the prompt group agrees with the capabilities.

    Which graphs a family needs, with which inputs and outputs, is the family's check (FamilyLayout.check)."""
    for name, g in manifest.graphs.items():
        if g.group not in (GROUP_CORE, GROUP_PROMPT, GROUP_FLOAT, GROUP_NATIVE):
            raise BundleError(f"manifest graph {name!r} is in the unknown group {g.group!r}")
        named = next((group for group, end in _TWINS.items() if name.endswith(end)), None)
        if named is not None and g.group != named:
            raise BundleError(f"manifest graph {name!r} is in group {g.group!r}, expected {named!r}")
        suffix = _TWINS.get(g.group)
        if suffix is None:
            continue
        core = manifest.graphs.get(name.removesuffix(suffix)) if name.endswith(suffix) else None
        # a native twin may read inputs of its kernels' own after its core graph's (a step's decode_spread, an
        # estimator's int8 caches' scales: layout.CACHE_SCALE_SUFFIX)
        inputs = g.inputs[: len(core.inputs)] if core is not None and g.group == GROUP_NATIVE else g.inputs
        if core is None or core.group != GROUP_CORE or (inputs, g.outputs) != (core.inputs, core.outputs):
            raise BundleError(
                f"manifest graph {name!r} must be named `<core graph>{suffix}` and have the inputs and outputs of its core graph"
            )
        if g.group == GROUP_NATIVE and g.precision != core.precision and (core.precision, g.precision) != ("fp32", "bf16"):
            raise BundleError(f"manifest graph {name!r} must have the precision of its core graph (or bf16 for an fp32 one)")
    caps, prompt = manifest.capabilities, manifest.graphs_in(GROUP_PROMPT)
    if prompt and not caps.prompt_analysis:
        raise BundleError(f"manifest lists prompt graphs ({', '.join(prompt)}) but does not declare prompt_analysis")
    if caps.prompt_analysis and not prompt:
        raise BundleError("manifest declares prompt_analysis but lists no prompt graph")
    if caps.instruct and not caps.builtin_speakers:
        raise BundleError("manifest declares instruct without builtin_speakers (instruct voices a built-in speaker)")
    if caps.instruct2 and not caps.prompt_analysis:
        raise BundleError("manifest declares instruct2 without prompt_analysis (instruct2 voices a prompt recording)")
    if not (caps.builtin_speakers or caps.prompt_analysis):
        raise BundleError("manifest declares neither builtin_speakers nor prompt_analysis: the model has no voice")


def _section(data: dict[str, Any], family: str) -> dict[str, Any]:
    """The family's own section (the key named like the family), {} when it has none."""
    section = data.get(family, {})
    if not isinstance(section, dict):
        raise BundleError(f"manifest key {family!r} (the family's constants) must be an object")
    return dict(section)


def _flag(data: dict[str, Any], key: str, default: bool = False) -> bool:
    """A boolean manifest key (absent = `default`); anything but true/false is a malformed manifest."""
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise BundleError(f"manifest key {key!r} must be true or false, got {value!r}")
    return value
