"""Command line: `python -m service synth ...` writes a WAV, `python -m service verify ...` replays fixtures."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import wave
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from service.errors import EmptyTextError, EngineError, InvalidInputError, TTSError, UnknownSpeakerError

if TYPE_CHECKING:
    from service.engine.types import AudioChunk
    from service.verify.checks import Check

# The frontend (inflect, wetext, jieba), scipy and the engine take seconds to import; they are imported
# inside the commands so that `--help` and input errors (bad bundle, unknown speaker) answer at once.

DEFAULT_BUNDLE = Path("models/tiny")
DEFAULT_SPEAKER = "中文女"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    description = "CosyVoice-300M and CosyVoice2-0.5B on ONNX Runtime (CPU)."
    parser = argparse.ArgumentParser(prog="python -m service", description=description)
    sub = parser.add_subparsers(dest="command", required=True)

    synth = sub.add_parser("synth", help="synthesize text to a 16-bit mono WAV file")
    synth.add_argument("--text", required=True, help="text to speak (Chinese, English, Japanese, ...)")
    synth.add_argument("--speaker", default=None, help="speaker name from the bundle's speakers.json (default: 中文女)")
    synth.add_argument("--prompt-wav", type=Path, default=None, help="clone the voice of this recording (1-30 s; any format)")
    synth.add_argument("--prompt-text", default="", help="the words spoken in --prompt-wav (zero-shot); empty: cross-lingual")
    synth.add_argument("--instruct", default=None, help="speak as this instruction says (CosyVoice-300M-Instruct, CosyVoice2)")
    synth.add_argument("--out", required=True, type=Path, help="output .wav path")
    synth.add_argument("--bundle", default=DEFAULT_BUNDLE, type=Path, help=f"model bundle directory (default: {DEFAULT_BUNDLE})")
    synth.add_argument("--stream", action="store_true", help="stream: print one line per chunk as it is produced")
    synth.add_argument("--seed", type=int, default=None, help="random seed (same seed and text give the same audio)")
    synth.add_argument("--speed", type=float, default=1.0, help="tempo factor (default 1.0)")
    synth.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")

    verify = sub.add_parser("verify", help="replay reference fixtures through a bundle and report errors")
    verify.add_argument("--bundle", default=DEFAULT_BUNDLE, type=Path, help=f"model bundle directory (default: {DEFAULT_BUNDLE})")
    verify.add_argument("--fixtures", required=True, type=Path, help="fixture directory (layout of tests/reference/tiny)")
    verify.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code (0 ok, 1 verification/engine failure, 2 bad input)."""
    args = build_parser().parse_args(argv)
    if args.threads < 1:
        print("error: --threads must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "synth":
            return synth_command(args)
        return verify_command(args)
    except EngineError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return EXIT_FAILED
    except TTSError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def synth_command(args: argparse.Namespace) -> int:
    """Text -> sentences -> audio chunks -> WAV, with a summary line (and one line per chunk with --stream)."""
    from service.families.registry import open_bundle

    bundle = open_bundle(args.bundle)
    prompt = args.prompt_wav.read_bytes() if args.prompt_wav is not None else None
    if prompt is None:
        speaker = args.speaker or DEFAULT_SPEAKER
        if speaker not in bundle.speakers:
            if not bundle.speakers:
                raise UnknownSpeakerError("the model has no built-in speakers: clone a voice with --prompt-wav")
            raise UnknownSpeakerError(f"unknown speaker {speaker!r}; available: {', '.join(bundle.speakers)}")
    elif args.speaker is not None:
        raise InvalidInputError("give --speaker or --prompt-wav, not both")
    if not args.text.strip():
        raise EmptyTextError("the text is empty")
    from service.engine.options import RuntimeOptions
    from service.engine.types import SynthesisOptions
    from service.families.model import InstructVoice, ModelContext, NamedVoice, PromptAudio, PromptVoice, VoiceReference
    from service.families.registry import load_model

    base: str | PromptVoice = PromptVoice(PromptAudio(prompt), args.prompt_text) if prompt is not None else speaker
    reference: VoiceReference = NamedVoice(base) if isinstance(base, str) else base
    if args.instruct is not None:
        reference = InstructVoice(base, args.instruct)
    context = ModelContext(options=RuntimeOptions(intra_op_threads=args.threads), prompt_analysis=prompt is not None)
    model = load_model(bundle, context)
    try:
        voice = model.resolve(reference)
        sentences = model.frontend.sentences(args.text)
        options = SynthesisOptions(speed=args.speed, seed=args.seed, stream=args.stream)
        start = time.perf_counter()
        chunks = model.synthesize([list(s.ids) for s in sentences], voice, options, threading.Event())
        total = write_wav(args.out, model.sample_rate, chunks, start if args.stream else None)
    finally:
        model.close()
    elapsed = time.perf_counter() - start
    seconds = total / model.sample_rate
    rtf = f"{elapsed / seconds:.2f}" if seconds else "n/a"
    print(f"wrote {args.out}: {len(sentences)} sentence(s), {total} samples = {seconds:.2f} s in {elapsed:.2f} s (RTF {rtf})")
    if bundle.manifest.warning:
        print(f"warning: {bundle.manifest.warning}", file=sys.stderr)
    return EXIT_OK


def write_wav(path: Path, sample_rate: int, chunks: Iterable[AudioChunk], progress_start: float | None) -> int:
    """Write chunks as 16-bit mono PCM; returns the sample count. The file appears only when complete.

    With `progress_start` (a perf_counter value) prints `chunk i sentence s samples n t=<seconds>` per chunk.
    """
    from service.audio.encode import float_to_int16

    partial = path.with_name(path.name + ".partial")
    total = 0
    try:
        with wave.open(str(partial), "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(sample_rate)
            for index, chunk in enumerate(chunks):
                wav.writeframes(float_to_int16(chunk.audio).tobytes())
                total += chunk.audio.size
                if progress_start is not None:
                    t = time.perf_counter() - progress_start
                    print(f"chunk {index} sentence {chunk.sentence_index} samples {chunk.audio.size} t={t:.3f}s", flush=True)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return total


def _format_check(check: Check) -> str:
    verdict = "ok" if check.ok else "FAIL"
    label = f"{check.stage:<9} {check.name}"
    return f"{label:<62} max_abs_err {check.error:<10.3g} tol {check.tolerance:<8.3g} {verdict}"


def verify_command(args: argparse.Namespace) -> int:
    """Print one line per compared quantity, list skipped files; exit 1 if anything is beyond tolerance."""
    from service.families.registry import open_bundle

    bundle = open_bundle(args.bundle)
    if not args.fixtures.is_dir():
        print(f"error: {args.fixtures}: not a directory", file=sys.stderr)
        return EXIT_USAGE
    from service.engine.options import RuntimeOptions
    from service.families.registry import run_verification

    report = run_verification(
        bundle,
        args.fixtures,
        RuntimeOptions(intra_op_threads=args.threads),
        on_check=lambda c: print(_format_check(c), flush=True),
    )
    for skipped in report.skipped:
        print(f"skipped   {skipped}")
    failed = [c for c in report.checks if not c.ok]
    if not report.checks:
        print("nothing verified: no fixture file found", file=sys.stderr)
        return EXIT_FAILED
    print(f"{len(report.checks) - len(failed)}/{len(report.checks)} checks within tolerance")
    return EXIT_FAILED if failed else EXIT_OK
