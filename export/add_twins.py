"""`python -m export.add_twins BUNDLE [--replace]`: give a quantized bundle the native twins its family's exporter
writes now (a bundle exported before a twin existed lacks it; `--replace` writes every twin again, e.g. an estimator
twin from before the block kernel). The rewrites are the family's (export.registry); the machinery is
export.native_twin's."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from export.external_data import externalize_bundle
from export.native_twin import drop_native_twins, write_native_twin
from export.onnx_io import ExportError
from export.registry import for_family
from service.bundle import ModelBundle
from service.errors import BundleError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Add the native twins a quantized bundle lacks (LLM step, estimator).")
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--replace", action="store_true", help="write every twin again (a twin from an older exporter)")
    args = parser.parse_args(argv)
    try:
        if args.replace:
            drop_native_twins(args.bundle)
        written = write_native_twin(args.bundle, for_family(ModelBundle.load(args.bundle).family).native_rewrites)
        if not written:
            print(f"{args.bundle}: no native twin to add (fp32 bundle, or it has every twin it takes)")
        externalize_bundle(args.bundle)
        ModelBundle.load(args.bundle, verify_hashes=True)
    except (ExportError, BundleError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
