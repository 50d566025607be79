"""CLI: export an official CosyVoice-300M (base, -SFT, -Instruct), CosyVoice2-0.5B or Fun-CosyVoice3-0.5B checkpoint to a
verified ONNX bundle."""

from __future__ import annotations

import argparse
import resource
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as `python export/export_onnx.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from export.config import ConfigError
from export.onnx_io import ExportError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="export_onnx.py",
        description=(
            "Export a CosyVoice-300M, -300M-SFT or -300M-Instruct checkpoint (cosyvoice.yaml, llm.pt, flow.pt, hift.pt; "
            "optional spk2info.pt, campplus.onnx + speech_tokenizer_v1.onnx), a CosyVoice2-0.5B one (cosyvoice2.yaml, "
            "llm.pt, flow.pt, hift.pt, CosyVoice-BlankEN/; campplus.onnx + speech_tokenizer_v2.onnx) or a Fun-CosyVoice3-0.5B "
            "one (cosyvoice3.yaml, the same files, speech_tokenizer_v3.onnx) to an ONNX bundle."
        ),
    )
    p.add_argument("--model-dir", required=True, type=Path, help="official checkpoint directory")
    p.add_argument("--out", required=True, type=Path, help="bundle directory to write (replaced atomically)")
    p.add_argument(
        "--quantize",
        choices=["int8", "int4"],
        action="append",
        default=[],
        help="also write OUT-int8 (dynamic INT8 LLM/flow weights) and/or OUT-int4 (4-bit LLM decode step); repeatable",
    )
    p.add_argument(
        "--random-init",
        action="store_true",
        help="seeded random weights from the config alone (cosyvoice.yaml; cosyvoice2.yaml or cosyvoice3.yaml + "
        "CosyVoice-BlankEN/config.json)",
    )
    p.add_argument(
        "--test-model",
        action="store_true",
        help="mark the bundle as a random-weight test model (manifest test_model/random_weights; the service warns)",
    )
    p.add_argument(
        "--model-name",
        help="model id in the manifest (default: the directory name if it is CosyVoice-300M, -300M-SFT or -300M-Instruct, "
        "else CosyVoice-300M-SFT)",
    )
    p.add_argument(
        "--instruct",
        action="store_true",
        help="declare the instruct capability (on by itself for a directory named *-Instruct); needs built-in speakers",
    )
    p.add_argument(
        "--no-prompt-models",
        action="store_true",
        help="leave campplus.onnx and speech_tokenizer_v1.onnx out of the bundle (no voice cloning)",
    )
    p.add_argument("--verify", action="store_true", help="check every graph against the torch modules in onnxruntime")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max abs error allowed by --verify (default 1e-4)")
    p.add_argument("--seed", type=int, default=0, help="seed for --random-init weights and speakers (default 0)")
    p.add_argument(
        "--tokenizer",
        type=Path,
        help="v1: whisper's multilingual.tiktoken (default: searched); CosyVoice2: a tokenizer.json, qwen.tiktoken or a "
        "directory with the Qwen2 tokenizer files (default: the checkpoint's CosyVoice-BlankEN)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.onnx.*")  # known, harmless folding notes
    import torch

    from export.bundle_writer import ExportOptions
    from export.registry import for_checkpoint

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if not args.model_dir.is_dir():
        print(f"error: --model-dir {args.model_dir} is not a directory", file=sys.stderr)
        return 2
    family = for_checkpoint(args.model_dir)
    opts = ExportOptions(
        model_dir=args.model_dir,
        out=args.out,
        random_init=args.random_init,
        seed=args.seed,
        verify=args.verify,
        tolerance=args.tolerance,
        quantize="int8" if "int8" in args.quantize else None,
        tokenizer=args.tokenizer,
        model_name=args.model_name or family.model_name(args.model_dir),
        test_model=args.test_model,
        instruct=args.instruct or family.instruct(args.model_dir),
        prompt_models=not args.no_prompt_models,
    )
    try:
        report = family.run_export(opts)
        int4_out = _write_int4(family.write_int4, args.out) if "int4" in args.quantize else None
    except (ExportError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    total = sum(report.sizes.values())
    extra = [str(p) for p in (report.int8_out, int4_out) if p]
    print(f"wrote {report.out} ({total / 1e6:.1f} MB of graphs)" + (f" and {', '.join(extra)}" if extra else ""))
    for name, size in sorted(report.sizes.items()):
        print(f"  {name:<24} {size / 1e6:10.2f} MB")
    print(f"export took {report.seconds:.1f} s, peak RSS {peak_mb:.0f} MB")
    return 0


def _write_int4(write: Callable[[Path], tuple[Path, dict[str, float]]], fp32_out: Path) -> Path:
    """Write OUT-int4 beside the fp32 bundle with the family's writer and print the decode step's deviation."""
    out, dev = write(fp32_out)
    print(
        f"int4 llm_step vs fp32 (deviation, not a failure): max |dlogp| {dev['logp_max_abs']:.3e}, "
        f"mean {dev['logp_mean_abs']:.3e}, top-1 agreement {dev['top1_agreement']:.0%}"
    )
    return out


if __name__ == "__main__":
    sys.exit(main())
