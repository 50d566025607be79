"""What a family's bundles hold (FamilyLayout), and the check a loaded bundle of that family must pass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from service.bundle.layout import FLOAT_SUFFIX, GROUP_NATIVE, GROUP_PROMPT, NATIVE_SUFFIX, SHARED_NATIVE_GRAPHS
from service.bundle.manifest import Manifest
from service.errors import BundleError

GraphIO = Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]
PromptGraphs = Mapping[str, tuple[str, tuple[str, ...], tuple[str, ...]]]  # name -> (file, inputs, outputs)


@dataclass(frozen=True)
class FamilyLayout:
    """What a bundle of one model family holds: its core graphs (name -> input and output names, with `{x}`
    templates expanded by `counts`), prompt models, tokenizer and other required files."""

    family: str
    graph_io: GraphIO
    prompt_graphs: PromptGraphs
    tokenizer: str
    required_files: tuple[str, ...]
    native_graphs: tuple[str, ...] = field(default=())  # core graphs that may have a native twin (and SHARED_NATIVE_GRAPHS)

    def check(self, manifest: Manifest, root: Path) -> None:
        """Refuse (BundleError) a manifest of another family, one that lacks a core graph, lists a graph this family
        does not know, or whose prompt models or files are not this layout's."""
        if manifest.family != self.family:
            raise BundleError(f"{root}: a {manifest.family!r} bundle, not a {self.family!r} one")
        missing = [g for g in self.graph_io if g not in manifest.graphs]
        if missing:
            raise BundleError(f"{root}: manifest lists no graph for {', '.join(missing)}")
        known = set(self.graph_io) | set(self.prompt_graphs)
        twins = (*self.native_graphs, *SHARED_NATIVE_GRAPHS)
        for name, entry in manifest.graphs.items():
            base = name.removesuffix(FLOAT_SUFFIX).removesuffix(NATIVE_SUFFIX)
            if base not in known or (entry.group == GROUP_NATIVE and base not in twins):
                raise BundleError(f"{root}: manifest graph {name!r} is not a graph of a {self.family} bundle")
            if (entry.group == GROUP_PROMPT) != (name in self.prompt_graphs):
                raise BundleError(f"{root}: manifest graph {name!r} is in group {entry.group!r}")
        self._check_prompt_graphs(manifest, root)
        absent = [f for f in (self.tokenizer, *self.required_files) if f not in manifest.files]
        if absent:
            raise BundleError(f"{root}: manifest lists no file {', '.join(absent)}")

    def _check_prompt_graphs(self, manifest: Manifest, root: Path) -> None:
        if not manifest.capabilities.prompt_analysis:
            return
        for name, (_, inputs, outputs) in self.prompt_graphs.items():
            entry = manifest.graphs.get(name)
            if entry is None:
                raise BundleError(f"{root}: manifest declares prompt_analysis but lists no graph for {name}")
            if (entry.inputs, entry.outputs) != (inputs, outputs):
                raise BundleError(
                    f"{root}: manifest graph {name!r} has inputs {list(entry.inputs)} / outputs {list(entry.outputs)}, "
                    f"expected {list(inputs)} / {list(outputs)}"
                )
