"""The model families this service knows, by the manifest's `family` name: the one module that imports a family."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from service.bundle import ModelBundle
from service.engine.sessions import RuntimeOptions
from service.errors import BundleError
from service.families import cosyvoice1, cosyvoice2
from service.families.model import Family, Model, ModelContext
from service.verify.checks import Check, VerifyReport

FAMILIES: dict[str, Family] = {f.name: f for f in (cosyvoice1.FAMILY, cosyvoice2.FAMILY)}


def family(name: str) -> Family:
    """The family a manifest names; BundleError naming the known ones otherwise."""
    found = FAMILIES.get(name)
    if found is None:
        raise BundleError(f"model family {name!r} is not known (known: {', '.join(FAMILIES)})")
    return found


def load_model(bundle: ModelBundle, context: ModelContext | None = None) -> Model:
    """The served model of `bundle`'s family (BundleError for a family that is verified but not served yet)."""
    entry = family(bundle.family)
    if entry.load is None:
        served = ", ".join(name for name, f in FAMILIES.items() if f.load is not None)
        raise BundleError(f"{bundle.root}: model family {entry.name!r} cannot be served yet (served: {served}); "
                          "`python -m service verify` checks it")  # fmt: skip
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
    return family(bundle.family).verify(bundle, Path(fixtures), runtime, on_check)
