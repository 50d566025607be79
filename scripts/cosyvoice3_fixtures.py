"""CLI: per-stage reference fixtures computed by the official Fun-CosyVoice3 code (pinned commit) on a checkpoint directory.

Runs in the official-side environment (torch, transformers, the official checkout; see
tests/reference/tiny-cosyvoice3/README.md for the exact setup and the command that regenerates the committed fixtures).
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Before torch loads OpenMP: spinning workers make torch many times slower on a shared host (docs/perf-log.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from cosyvoice2_fixtures import environment, tolerance
from cv2_reference import environment as env
from cv2_reference import output
from cv3_reference import readme_tables
from cv3_reference.cases import MODE_CASES, STREAM_CASES

LAYOUT = (
    "cosyvoice3.yaml",
    "llm.pt",
    "flow.pt",
    "hift.pt",
    "campplus.onnx",
    "speech_tokenizer_v3.onnx",
    "CosyVoice-BlankEN/config.json",
)
MODES = ("zero_shot", "cross_lingual", "instruct2")
SAMPLES_PER_FRAME = 480


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cosyvoice3_fixtures.py", description=__doc__.splitlines()[0])
    p.add_argument("--official", type=Path, help="official CosyVoice checkout at commit ace7c47 (required unless --readme-only)")
    p.add_argument("--checkpoint", type=Path, help="checkpoint directory in the Fun-CosyVoice3-0.5B layout (idem)")
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
        raise env.OfficialCheckoutError(
            f"{args.checkpoint} is not in the Fun-CosyVoice3-0.5B layout: missing {', '.join(missing)}"
        )
    used = {"official": env.check_official_checkout(args.official), "matcha": env.add_official_paths(args.official)}
    used["torchaudio"] = env.install_torchaudio(args.torchaudio_wheel)
    if args.wetext_rules is not None:
        used["wetext_rules"] = f"{args.wetext_rules.name}: {', '.join(f'{m} as {d}' for d, m in env.WETEXT_RULES.items())}"
    return used


def load_model(checkpoint: Path, threads: int) -> Any:
    import logging

    import torch

    torch.set_num_threads(threads)
    from cosyvoice.cli.cosyvoice import CosyVoice3

    logging.getLogger().setLevel(logging.WARNING)
    return CosyVoice3(str(checkpoint))


def collect(args: argparse.Namespace, threads: int) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Every official run on a freshly loaded model: npz name -> arrays, and the metadata."""
    from cv2_reference.recorder import to_numpy
    from cv3_reference import defects, frontend_fixtures, mode_fixtures, stream_fixtures

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
    prompt_frames = files["zero_shot"]["case0_mi_prompt_speech_feat"].shape[0]
    flow_mel = files["zero_shot"]["case0_flow_solver_out"][:, prompt_frames:]
    files["hift"], meta["hift"] = stream_fixtures.hift_cases(cv, flow_mel)
    meta["hift_rand_ini_check"] = stream_fixtures.rand_ini_reaches_output(cv)
    meta["official_defects"] = defects.all_checks(cv, args.prompts, meta["prompts"]["zh_16k"]["trimmed_tokens"])
    files["noise"], meta["noise"] = noise_fixture(cv, files)
    return files, meta


def noise_fixture(cv: Any, files: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The prefixes of the fixed noise tensors that the recorded calls used, their digests and how they are made."""
    import numpy as np
    import torch
    from cv3_reference import noise

    objects = noise.tensors(cv.model.flow, cv.model.hift)
    frames = [v.shape[-1] for arrays in files.values() for k, v in arrays.items() if k.endswith("flow_solver_out")]
    frames += [v.shape[-1] for k, v in files["stream"].items() if k.endswith("flow_new_mu")]  # bounded by solver_out
    samples = [v.shape[-1] for arrays in files.values() for k, v in arrays.items() if k.endswith(("hift_source", "source"))]
    torch.manual_seed(0)
    regenerated = torch.randn([1, 80, 50 * 300])
    arrays = {
        "flow_rand_noise": objects["flow_rand_noise"][0, :, : max(frames)].numpy(),
        "hift_rand_ini": objects["hift_rand_ini"][0].numpy(),
        "hift_sine_waves": objects["hift_sine_waves"][0, : max(samples)].numpy(),
    }
    return {k: np.array(v, copy=True) for k, v in arrays.items()}, {
        "flow_recipe": noise.FLOW_NOISE_RECIPE,
        "flow_recipe_reproduces_buffer": bool(torch.equal(regenerated, objects["flow_rand_noise"])),
        "hift_recipe": noise.HIFT_NOISE_RECIPE,
        "digests": noise.buffer_digests(cv.model.flow, cv.model.hift),
        "stored_flow_frames": int(max(frames)),
        "stored_hift_samples": int(max(samples)),
        "samples_per_frame": SAMPLES_PER_FRAME,
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
    meta["environment"]["packages"]["x-transformers"] = version("x-transformers")  # the DiT's rotary embedding
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
