"""The model families this service knows, by the manifest's `family` name: the one module that imports a family."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.errors import BundleError
from service.families.cosyvoice1.family import FAMILY as COSYVOICE1
from service.families.cosyvoice2.family import FAMILY as COSYVOICE2
from service.families.cosyvoice3.family import FAMILY as COSYVOICE3
from service.families.model import Family, Model, ModelContext
from service.verify.checks import Check, VerifyReport

FAMILIES: dict[str, Family] = {f.name: f for f in (COSYVOICE1, COSYVOICE2, COSYVOICE3)}


def family(name: str) -> Family:
    """The family a manifest names; BundleError naming the known ones otherwise."""
    found = FAMILIES.get(name)
    if found is None:
        raise BundleError(f"model family {name!r} is not known (known: {', '.join(FAMILIES)})")
    return found


def open_bundle(path: str | Path, *, verify_hashes: bool = False) -> ModelBundle:
    """Load the bundle at `path` and check it against its family's layout (BundleError, one clear line)."""
    bundle = ModelBundle.load(path, verify_hashes=verify_hashes)
    family(bundle.family).check_bundle(bundle)
    return bundle


def load_model(bundle: ModelBundle, context: ModelContext | None = None) -> Model:
    """The served model of `bundle`'s family (BundleError for a family that is verified but not served yet)."""
    entry = family(bundle.family)
    if entry.load is None:
        served = ", ".join(name for name, f in FAMILIES.items() if f.load is not None)
        raise BundleError(f"{bundle.root}: model family {entry.name!r} cannot be served yet (served: {served}); "
                          "`python -m service verify` checks it")  # fmt: skip
    entry.check_bundle(bundle)
    return entry.load(bundle, context or ModelContext())


def check_options(bundle: ModelBundle, options: RuntimeOptions) -> None:
    """Refuse, before anything is loaded, options `bundle`'s family cannot honour (SettingError naming the field)."""
    check = family(bundle.family).check
    if check is not None:
        check(bundle, options)


def run_verification(
    bundle: ModelBundle,
    fixtures: Path,
    runtime: RuntimeOptions | None = None,
    on_check: Callable[[Check], None] | None = None,
) -> VerifyReport:
    """Replay the fixtures in `fixtures` through `bundle` with its family's checks (`python -m service verify`)."""
    entry = family(bundle.family)
    entry.check_bundle(bundle)
    return entry.verify(bundle, Path(fixtures), runtime, on_check)
