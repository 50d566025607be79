"""CLI: a random-weight CosyVoice2 checkpoint in the official layout, or the full-size shapes table, from the official code.

Runs in the official-side environment (torch, the pinned official checkout; see tests/reference/tiny-cosyvoice2/README.md):
    python scripts/cosyvoice2_checkpoint.py build --official OFFICIAL --size tiny --out DIR --qwen-ranks dashscope.whl
    python scripts/cosyvoice2_checkpoint.py shapes --official OFFICIAL --out tests/reference/cosyvoice2-0.5b.shapes.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cv2_reference import checkpoint as ck
from cv2_reference import environment as env
from cv2_reference.qwen_tokenizer import write_tokenizer_files
from cv2_reference.standins import write_standins


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cosyvoice2_checkpoint.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_text in (("build", "write a random checkpoint directory"), ("shapes", "write the shapes JSON of a size")):
        q = sub.add_parser(name, help=help_text)
        q.add_argument("--official", required=True, type=Path, help="official CosyVoice checkout at commit ace7c47")
        q.add_argument("--out", required=True, type=Path, help="checkpoint directory (build) or JSON file (shapes)")
        q.add_argument("--size", choices=sorted(ck.SIZES), default="tiny" if name == "build" else "full")
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


def write_blank_config(blank: Path, size: ck.Size) -> None:
    """config.json, generation_config.json and a model.safetensors that from_pretrained can build from.

    The weights file holds a freshly initialized Qwen2 body (RMSNorm weights 1, linear layers N(0, 0.02)) without the
    text embedding; from_pretrained initializes the embedding (and the head tied to it). Tensors missing from the file
    would otherwise be left as uninitialized memory by transformers 4.51 (the RMSNorm weights are not re-initialized).
    """
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    blank.mkdir(parents=True, exist_ok=True)
    ck.write_json(blank / "config.json", ck.qwen2_config(size))
    ck.write_json(blank / "generation_config.json", ck.GENERATION_CONFIG)
    body = Qwen2ForCausalLM(Qwen2Config(**ck.qwen2_config(size))).state_dict()
    save_file(
        {k: v.contiguous() for k, v in body.items() if "embed_tokens" not in k and not k.startswith("lm_head")},
        str(blank / "model.safetensors"),
        metadata={"format": "pt"},
    )


def build_modules(yaml_text: str, blank: Path) -> dict[str, Any]:
    """llm, flow and hift as the official yaml builds them (default init, the yaml's own seeds)."""
    from hyperpyyaml import load_hyperpyyaml

    configs = load_hyperpyyaml(yaml_text, overrides={"qwen_pretrain_path": str(blank)})
    return {name: configs[name] for name in ("llm", "flow", "hift")}


def write_body_weights(llm_state: dict[str, Any], blank: Path) -> None:
    """CosyVoice-BlankEN/model.safetensors: the Qwen2 body of llm.pt without its 151,936-row embedding (and tied head).

    from_pretrained initializes the two missing tensors itself; CosyVoice2Model.load then overwrites every weight.
    """
    from safetensors.torch import save_file

    body = {
        key.removeprefix("llm.model."): value.contiguous().clone()
        for key, value in llm_state.items()
        if key.startswith("llm.model.model.") and not key.endswith("embed_tokens.weight")
    }
    save_file(body, str(blank / "model.safetensors"), metadata={"format": "pt"})
    (blank / "model.safetensors").chmod(0o644)  # safetensors writes 0600


def build(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    torch.manual_seed(args.seed)  # the default init that sets each tensor's scale (values are then redrawn from numpy)
    size = ck.SIZES[args.size]
    yaml_text, _ = ck.resized_yaml((args.official / ck.OFFICIAL_YAML).read_text(encoding="utf-8"), size)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cosyvoice2.yaml").write_text(yaml_text, encoding="utf-8")
    blank = args.out / ck.BLANK
    write_tokenizer_files(args.qwen_ranks, blank)
    write_blank_config(blank, size)
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
    size = ck.SIZES[args.size]
    yaml_text, changes = ck.resized_yaml((args.official / ck.OFFICIAL_YAML).read_text(encoding="utf-8"), size)
    with tempfile.TemporaryDirectory() as tmp:
        write_blank_config(Path(tmp), size)
        modules = build_modules(yaml_text, Path(tmp))
    tables = {f"{name}.pt": module.state_dict() for name, module in modules.items()}
    tied = {f"{name}.pt": ck.tied_keys(module) for name, module in modules.items()}
    payload = {
        "_about": (
            f"Shapes/dtypes of every state_dict entry of a CosyVoice2 checkpoint of size '{args.size}' in the official "
            "CosyVoice2-0.5B layout (official classes from cosyvoice2.yaml at commit ace7c47, default init; no download). "
            "CosyVoice2Model.load() reads llm.pt, flow.pt, hift.pt with strict=True. Keys starting with '_' are metadata; "
            "every other top-level key is a file name. '_tied' lists keys that share one tensor (written once)."
        ),
        "_config": {
            "yaml": f"official {ck.OFFICIAL_YAML} at commit {env.PINNED_COMMIT[:7]}",
            "size": args.size,
            "changes": [{"key": key, "official": old, "here": new} for key, old, new in changes],
        },
        "_qwen2_config": ck.qwen2_config(size),
        "_param_counts": {name: ck.param_counts(state, tied[name]) for name, state in tables.items()},
        "_tied": {name: pairs for name, pairs in tied.items() if pairs},
        "_tensor_counts": {name: len(state) for name, state in tables.items()},
        **{name: ck.describe(state) for name, state in tables.items()},
    }
    ck.write_json(args.out, payload)
    print(f"wrote {args.out}")


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
