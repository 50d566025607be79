"""CLI: a random-weight Fun-CosyVoice3 checkpoint in the official layout, or the full-size shapes table, from the official code.

Runs in the official-side environment (torch, the pinned official checkout; see tests/reference/tiny-cosyvoice3/README.md):
    python scripts/cosyvoice3_checkpoint.py build --official OFFICIAL --size tiny --out DIR --qwen-ranks dashscope.whl
    python scripts/cosyvoice3_checkpoint.py shapes --official OFFICIAL --out tests/reference/fun-cosyvoice3-0.5b.shapes.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cosyvoice2_checkpoint import build_modules, write_blank_config, write_body_weights
from cv2_reference import checkpoint as ck
from cv2_reference import environment as env
from cv2_reference.qwen_tokenizer import write_tokenizer_files
from cv3_reference import checkpoint as ck3
from cv3_reference.noise import buffer_digests
from cv3_reference.standins import write_standins


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cosyvoice3_checkpoint.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_text in (("build", "write a random checkpoint directory"), ("shapes", "write the shapes JSON of a size")):
        q = sub.add_parser(name, help=help_text)
        q.add_argument("--official", required=True, type=Path, help="official CosyVoice checkout at commit ace7c47")
        q.add_argument("--out", required=True, type=Path, help="checkpoint directory (build) or JSON file (shapes)")
        q.add_argument("--size", choices=sorted(ck3.SIZES), default="tiny" if name == "build" else "full")
        q.add_argument("--seed", type=int, default=0, help="numpy seed of every weight and stand-in (default 0)")
        q.add_argument("--torchaudio-wheel", type=Path, help="torchaudio wheel whose pure-Python modules to use")
    sub.choices["build"].add_argument(
        "--qwen-ranks", required=True, type=Path, help="qwen.tiktoken, or the dashscope wheel that ships it"
    )
    return p.parse_args(argv)


def prepare(args: argparse.Namespace) -> None:
    env.check_official_checkout(args.official)
    env.add_official_paths(args.official)
    env.install_torchaudio(args.torchaudio_wheel)


def build(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    torch.manual_seed(args.seed)  # the default init that sets each tensor's scale (values are then redrawn from numpy)
    size = ck3.SIZES[args.size]
    yaml_text, _ = ck3.resized_yaml((args.official / ck3.OFFICIAL_YAML).read_text(encoding="utf-8"), size)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / ck3.YAML_NAME).write_text(yaml_text, encoding="utf-8")
    blank = args.out / ck3.BLANK
    write_tokenizer_files(args.qwen_ranks, blank)
    write_blank_config(blank, size)  # type: ignore[arg-type]  # same llm_* fields as cv2's Size
    modules = build_modules(yaml_text, blank)
    rng = np.random.RandomState(args.seed)
    for name, module in modules.items():
        state = ck.random_state_dict(module.state_dict(), rng, ck.tied_keys(module))
        module.load_state_dict(state, strict=True)
        torch.save(state, args.out / f"{name}.pt")
        if name == "llm":
            write_body_weights(state, blank)
    write_standins(args.out, args.seed)
    print(f"wrote {args.out} ({args.size}, seed {args.seed})")


def shapes(args: argparse.Namespace) -> None:
    size = ck3.SIZES[args.size]
    yaml_text, changes = ck3.resized_yaml((args.official / ck3.OFFICIAL_YAML).read_text(encoding="utf-8"), size)
    with tempfile.TemporaryDirectory() as tmp:
        write_blank_config(Path(tmp), size)  # type: ignore[arg-type]
        modules = build_modules(yaml_text, Path(tmp))
    tables = {f"{name}.pt": module.state_dict() for name, module in modules.items()}
    tied = {f"{name}.pt": ck.tied_keys(module) for name, module in modules.items()}
    payload: dict[str, Any] = {
        "_about": (
            f"Shapes/dtypes of every state_dict entry of a Fun-CosyVoice3 checkpoint of size '{args.size}' in the official "
            "Fun-CosyVoice3-0.5B layout (official classes from cosyvoice3.yaml at commit ace7c47, default init; no "
            "download). CosyVoice3Model.load() reads llm.pt, flow.pt, hift.pt with strict=True. Keys starting with '_' are "
            "metadata; every other top-level key is a file name. '_tied' lists keys that share one tensor (written once). "
            "'_noise_buffers': the fixed noise tensors the official classes draw from torch's global generator while the "
            "yaml is loaded (not in any state_dict): their sha256 for this size, torch " + _torch_version() + "."
        ),
        "_config": {
            "yaml": f"official {ck3.OFFICIAL_YAML} at commit {env.PINNED_COMMIT[:7]}",
            "size": args.size,
            "changes": [{"key": key, "official": old, "here": new} for key, old, new in changes],
        },
        "_qwen2_config": ck.qwen2_config(size),  # type: ignore[arg-type]
        "_param_counts": {name: ck.param_counts(state, tied[name]) for name, state in tables.items()},
        "_tied": {name: pairs for name, pairs in tied.items() if pairs},
        "_tensor_counts": {name: len(state) for name, state in tables.items()},
        "_noise_buffers": buffer_digests(modules["flow"], modules["hift"]),
        **{name: ck.describe(state) for name, state in tables.items()},
    }
    ck.write_json(args.out, payload)
    print(f"wrote {args.out}")


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        prepare(args)
    except env.OfficialCheckoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    build(args) if args.command == "build" else shapes(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
