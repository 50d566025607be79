"""CLI: per-stage reference fixtures computed by the official CosyVoice2 code (pinned commit) on any checkpoint directory.

Runs in the official-side environment (torch, transformers, the official checkout; see
tests/reference/tiny-cosyvoice2/README.md for the exact setup and the command that regenerates the committed fixtures).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Before torch loads OpenMP: spinning workers make torch many times slower on a shared host (docs/perf-log.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from cv2_reference import environment as env
from cv2_reference import output, readme_tables
from cv2_reference.cases import MODE_CASES, STREAM_CASES

LAYOUT = (
    "cosyvoice2.yaml",
    "llm.pt",
    "flow.pt",
    "hift.pt",
    "campplus.onnx",
    "speech_tokenizer_v2.onnx",
    "CosyVoice-BlankEN/config.json",
)
MODES = ("zero_shot", "cross_lingual", "instruct2")
NOISE_RECIPE = (
    "set_all_random_seed(0); torch.randn([1, 80, 50 * 300]) in CausalConditionalCFM.__init__ (flow_matching.py:199-200)"
)
CASE_PREFIX = re.compile(r"^(case\d+_|zs_|cl_|i2_|k\d+_)+")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cosyvoice2_fixtures.py", description=__doc__.splitlines()[0])
    p.add_argument("--official", type=Path, help="official CosyVoice checkout at commit ace7c47 (required unless --readme-only)")
    p.add_argument("--checkpoint", type=Path, help="checkpoint directory in the CosyVoice2-0.5B layout (idem)")
    p.add_argument("--prompts", type=Path, help="folder with zh_16k.wav, en_24k.wav, en_48k_stereo.wav (idem)")
    p.add_argument("--out", required=True, type=Path, help="folder for the fixture files (created)")
    p.add_argument("--torchaudio-wheel", type=Path, help="torchaudio wheel whose pure-Python modules to use")
    p.add_argument("--wetext-rules", type=Path, help="WeTextProcessing wheel with the zh/en TN rule files for wetext 0.0.4")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the stored run (default 1)")
    p.add_argument("--no-repeat", action="store_true", help="skip the repeated runs behind the tolerance figures")
    p.add_argument("--readme", type=Path, help="fill the generated tables of this README (file list, arrays, cases)")
    p.add_argument("--readme-only", action="store_true", help="only refill --readme from the fixture files already in --out")
    args = p.parse_args(argv)
    if args.readme_only and args.readme is None:
        p.error("--readme-only needs --readme")
    if not args.readme_only and None in (args.official, args.checkpoint, args.prompts):
        p.error("--official, --checkpoint and --prompts are required (unless --readme-only)")
    return args


def prepare(args: argparse.Namespace) -> dict[str, str]:
    """Check the checkout and the checkpoint layout; import paths and the offline stand-ins. Returns what was used."""
    missing = [name for name in LAYOUT if not (args.checkpoint / name).is_file()]
    if missing:
        raise env.OfficialCheckoutError(f"{args.checkpoint} is not in the CosyVoice2-0.5B layout: missing {', '.join(missing)}")
    used = {"official": env.check_official_checkout(args.official), "matcha": env.add_official_paths(args.official)}
    used["torchaudio"] = env.install_torchaudio(args.torchaudio_wheel)
    if args.wetext_rules is not None:
        used["wetext_rules"] = f"{args.wetext_rules.name}: {', '.join(f'{m} as {d}' for d, m in env.WETEXT_RULES.items())}"
    return used


def load_model(checkpoint: Path, threads: int) -> Any:
    import logging

    import torch

    torch.set_num_threads(threads)
    from cosyvoice.cli.cosyvoice import CosyVoice2

    logging.getLogger().setLevel(logging.WARNING)
    return CosyVoice2(str(checkpoint))


def collect(args: argparse.Namespace, threads: int) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Every official run on a freshly loaded model: npz name -> arrays, and the metadata."""
    from cv2_reference import defects, frontend_fixtures, mode_fixtures, stream_fixtures
    from cv2_reference.recorder import to_numpy

    cv = load_model(args.checkpoint, threads)
    files: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {}
    files["prompts"], meta["prompts"] = frontend_fixtures.prompt_analysis(cv, args.prompts, args.checkpoint)
    meta["tokenizer_cases"] = frontend_fixtures.tokenizer_fixture(cv, args.checkpoint)
    rand_noise = to_numpy(cv.model.flow.decoder.rand_noise)
    for mode in MODES:
        files[mode], meta[mode] = {}, []
        for i, case in enumerate(c for c in MODE_CASES if c.mode == mode):
            arrays, case_meta = mode_fixtures.mode_case(cv, case, args.prompts, rand_noise, first=i == 0)
            files[mode].update({f"case{i}_{k}": v for k, v in arrays.items()})
            meta[mode].append(case_meta)
    files["stream"], meta["stream"] = {}, {}
    for sc in STREAM_CASES:
        tokens = meta["prompts"][sc.case.prompt]["trimmed_tokens"]
        arrays, meta["stream"][sc.name] = stream_fixtures.stream_case(cv, sc, args.prompts, tokens, full=sc.name == "zs")
        files["stream"].update(arrays)
    files["hift"], meta["hift"] = stream_fixtures.hift_cases(cv, files["zero_shot"]["case0_hift_mel"])
    probe_tokens = meta["prompts"]["zh_16k"]["trimmed_tokens"]
    meta["official_defects"] = {
        "token_hop_len_not_reset": defects.hop_not_reset(cv, args.prompts, probe_tokens),
        "speed_ignored_when_streaming": defects.speed_in_stream(cv, args.prompts, probe_tokens),
        "server_passes_tensor_prompt": defects.tensor_prompt(cv, args.prompts),
    }
    files["flow_noise"], meta["flow_noise"] = noise_fixture(rand_noise, files, meta)
    return files, meta


def noise_fixture(
    rand_noise: Any, files: dict[str, dict[str, Any]], meta: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The prefix of CausalConditionalCFM.rand_noise that the recorded calls used, and how the buffer is made."""
    import numpy as np
    import torch

    frames = [v.shape[-1] for arrays in files.values() for k, v in arrays.items() if k.endswith(("flow_mu", "flow_solver_out"))]
    frames += [n for run in meta["stream"].values() for n in run["schedule"]["chunk_flow_frames"]]
    torch.manual_seed(0)
    regenerated = torch.randn([1, 80, 50 * 300]).numpy()
    return {"rand_noise": rand_noise[0, :, : max(frames)]}, {
        "recipe": NOISE_RECIPE,
        "shape": list(rand_noise.shape),
        "sha256_float32_le": hashlib.sha256(rand_noise.astype("<f4").tobytes()).hexdigest(),
        "recipe_reproduces_buffer": bool(np.array_equal(regenerated, rand_noise)),
        "stored_frames": int(max(frames)),
    }


def tolerance(stored: dict[str, dict[str, Any]], other: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Largest |difference| per file and array kind (case/chunk prefix removed); integer arrays must be identical."""
    import numpy as np

    kinds: dict[str, float] = {}
    integer_differences = []
    for name, arrays in stored.items():
        for key, value in arrays.items():
            kind = f"{name}/{CASE_PREFIX.sub('', key)}"
            if value.dtype.kind in "iub":
                if not np.array_equal(value, other[name][key]):
                    integer_differences.append(f"{name}/{key}")
                continue
            kinds[kind] = max(kinds.get(kind, 0.0), float(np.abs(value - other[name][key]).max()) if value.size else 0.0)
    return {"integer_arrays_differing": integer_differences, "float_max_abs_by_kind": dict(sorted(kinds.items()))}


def environment(used: dict[str, str], threads: int) -> dict[str, Any]:
    from importlib.metadata import version

    packages = (
        "torch",
        "transformers",
        "tokenizers",
        "numpy",
        "onnxruntime",
        "openai-whisper",
        "HyperPyYAML",
        "diffusers",
        "wetext",
    )
    return {
        **used,
        "python": platform.python_version(),
        "threads": threads,
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "packages": {name: version(name) for name in packages},
    }


def write(args: argparse.Namespace, files: dict[str, dict[str, Any]], meta: dict[str, Any]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    for name, arrays in files.items():
        output.save_npz(args.out / f"{name}.npz", arrays)
    output.save_json(args.out / "tokenizer_cases.json", meta["tokenizer_cases"])
    output.save_json(args.out / "fixtures_meta.json", {k: v for k, v in meta.items() if k != "tokenizer_cases"})
    if args.readme is not None:
        readme_tables.refresh(args.out, args.readme)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.readme_only:
        readme_tables.refresh(args.out, args.readme)
        return 0
    try:
        used = prepare(args)
    except env.OfficialCheckoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.wetext_rules is not None:
        env.install_wetext_rules(args.wetext_rules)
    files, meta = collect(args, args.threads)
    meta = {"environment": environment(used, args.threads), **meta}
    if not args.no_repeat:
        again, _ = collect(args, args.threads)
        other = 2 if args.threads == 1 else 1
        changed, _ = collect(args, other)
        meta["tolerance"] = {
            f"repeat_same_process_{args.threads}_threads": tolerance(files, again),
            f"repeat_{other}_threads_vs_{args.threads}": tolerance(files, changed),
        }
    write(args, files, meta)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
