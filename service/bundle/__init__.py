"""Model bundle: the manifest schema shared with export/ (layout, constants, manifest) and ModelBundle.load() (files)."""

from service.bundle.constants import CosyVoice2Constants, ModelConstants, relative_pe
from service.bundle.files import ModelBundle, read_speakers, sha256_file, write_speakers
from service.bundle.layout import (
    FAMILIES,
    FAMILY_V1,
    FAMILY_V2,
    FLOAT_SUFFIX,
    FORMAT_VERSION,
    GRAPH_IO,
    GRAPH_NAMES,
    GROUP_CORE,
    GROUP_FLOAT,
    GROUP_NATIVE,
    GROUP_PROMPT,
    MANIFEST_NAME,
    NATIVE_DOMAIN,
    NATIVE_GRAPHS,
    NATIVE_SUFFIX,
    PROMPT_GRAPH_NAMES,
    PROMPT_GRAPHS,
    SPEAKERS_NAME,
    TOKENIZER_NAME,
    V2_GRAPH_IO,
    V2_NOISE_NAME,
    V2_PROMPT_GRAPHS,
    V2_TOKENIZER_NAME,
    FamilyLayout,
    expand_io_names,
    family_layout,
)
from service.bundle.manifest import Capabilities, GraphEntry, Manifest

__all__ = [
    "FAMILIES", "FAMILY_V1", "FAMILY_V2", "FLOAT_SUFFIX", "FORMAT_VERSION", "GRAPH_IO", "GRAPH_NAMES", "GROUP_CORE",
    "GROUP_FLOAT", "GROUP_NATIVE", "GROUP_PROMPT", "MANIFEST_NAME", "NATIVE_DOMAIN", "NATIVE_GRAPHS", "NATIVE_SUFFIX",
    "PROMPT_GRAPHS", "PROMPT_GRAPH_NAMES", "SPEAKERS_NAME",
    "TOKENIZER_NAME", "V2_GRAPH_IO", "V2_NOISE_NAME", "V2_PROMPT_GRAPHS", "V2_TOKENIZER_NAME", "Capabilities",
    "CosyVoice2Constants", "FamilyLayout", "GraphEntry", "Manifest", "ModelBundle", "ModelConstants", "expand_io_names",
    "family_layout", "read_speakers", "relative_pe", "sha256_file", "write_speakers",
]  # fmt: skip
