"""Model bundle: the family-neutral manifest contract shared with export/ (layout, constants, manifest) and
ModelBundle.load() (files). A family's own layout and constants live in its contract module."""

from service.bundle.constants import ModelConstants
from service.bundle.family import FamilyLayout
from service.bundle.files import ModelBundle, read_speakers, sha256_file, write_speakers
from service.bundle.layout import (
    CACHE_SCALE_SUFFIX,
    FLOAT_SUFFIX,
    FORMAT_VERSION,
    GROUP_CORE,
    GROUP_FLOAT,
    GROUP_NATIVE,
    GROUP_PROMPT,
    LEGACY_FAMILY,
    MANIFEST_NAME,
    NATIVE_DOMAIN,
    NATIVE_SUFFIX,
    SPEAKERS_NAME,
    expand_io_names,
)
from service.bundle.manifest import Capabilities, GraphEntry, Manifest

__all__ = [
    "CACHE_SCALE_SUFFIX",
    "FLOAT_SUFFIX", "FORMAT_VERSION", "GROUP_CORE", "GROUP_FLOAT", "GROUP_NATIVE", "GROUP_PROMPT", "LEGACY_FAMILY",
    "MANIFEST_NAME", "NATIVE_DOMAIN", "NATIVE_SUFFIX", "SPEAKERS_NAME", "Capabilities", "FamilyLayout", "GraphEntry",
    "Manifest", "ModelBundle", "ModelConstants", "expand_io_names", "read_speakers", "sha256_file", "write_speakers",
]  # fmt: skip
