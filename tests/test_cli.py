"""`python -m service` as a subprocess on the tiny bundle: synth writes a WAV, verify replays fixtures, bad input exits 2."""

from __future__ import annotations

import shutil
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from service.bundle import ModelBundle
from service.families.cosyvoice1.contract import TOKENIZER_NAME
from service.frontend import TextFrontend


def run_cli(repo_root: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *map(str, args)],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )


def read_wav(path: Path) -> tuple[wave._wave_params, np.ndarray]:
    with wave.open(str(path), "rb") as w:
        return w.getparams(), np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)


def test_synth_writes_a_16_bit_mono_wav_and_a_seed_repeats_it(repo_root: Path, tiny_bundle: Path, tmp_path: Path) -> None:
    outs = [tmp_path / "a.wav", tmp_path / "b.wav"]
    for out in outs:
        proc = run_cli(
            repo_root, "synth", "--text", "你好。", "--speaker", "中文男", "--out", out, "--seed", "7", "--bundle", tiny_bundle
        )
        assert proc.returncode == 0, proc.stderr
        assert f"wrote {out}" in proc.stdout
        assert "random weights: its audio is noise" in proc.stderr  # the tiny test model says what it is
    params, audio = read_wav(outs[0])
    assert (params.nchannels, params.sampwidth, params.framerate) == (1, 2, 22050)
    # The random-weight LLM does not emit EOS for this seed, so it stops at max_len = 20 * T_txt tokens.
    bundle = ModelBundle.load(tiny_bundle)
    (sentence,) = TextFrontend.load(bundle.file(TOKENIZER_NAME)).sentences("你好。")
    frames = bundle.constants.tokens_to_mel_frames(20 * len(sentence.ids))
    assert audio.size == frames * bundle.constants.mel_hop_samples
    assert np.abs(audio).max() > 0
    assert outs[0].read_bytes() == outs[1].read_bytes()
    assert not list(tmp_path.glob("*.partial"))


def test_synth_stream_prints_one_line_per_chunk(repo_root: Path, tiny_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "s.wav"
    text = "今天天气很好，我们一起去公园散步吧。"
    proc = run_cli(repo_root, "synth", "--text", text, "--out", out, "--stream", "--seed", "1", "--bundle", tiny_bundle)
    assert proc.returncode == 0, proc.stderr
    lines = [ln.split() for ln in proc.stdout.splitlines() if ln.startswith("chunk ")]
    assert len(lines) >= 2  # at least 60 tokens: a first chunk and a final one
    assert [int(ln[1]) for ln in lines] == list(range(len(lines)))
    samples = sum(int(ln[5]) for ln in lines)
    times = [float(ln[6].removeprefix("t=").removesuffix("s")) for ln in lines]
    assert times == sorted(times)
    _, audio = read_wav(out)
    assert audio.size == samples


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--speaker", "nobody", "--text", "你好"), "unknown speaker"),
        (("--text", "   "), "empty"),
        (("--text", "。，！"), "nothing to speak"),
    ],
)
def test_bad_synth_input_exits_2_with_one_line(
    repo_root: Path, tiny_bundle: Path, tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    out = tmp_path / "x.wav"
    proc = run_cli(repo_root, "synth", *args, "--out", out, "--bundle", tiny_bundle)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_a_directory_that_is_not_a_bundle_exits_2(repo_root: Path, tmp_path: Path) -> None:
    for command in (("synth", "--text", "hi", "--out", tmp_path / "x.wav"), ("verify", "--fixtures", tmp_path)):
        proc = run_cli(repo_root, *command, "--bundle", tmp_path)
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines() == [f"error: {tmp_path}: not a model bundle (manifest.json is missing)"]


def test_verify_passes_on_the_reference_fixtures(repo_root: Path, tiny_bundle: Path, ref_dir: Path) -> None:
    proc = run_cli(repo_root, "verify", "--bundle", tiny_bundle, "--fixtures", ref_dir, "--threads", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stages = {ln.split()[0] for ln in proc.stdout.splitlines() if ln.endswith(" ok")}
    assert stages == {"tokenizer", "llm", "flow", "hift", "stream", "prompt", "zero_shot", "cross_lingual", "instruct"}
    assert "FAIL" not in proc.stdout and "skipped" not in proc.stdout


def test_verify_fails_beyond_tolerance_and_names_skipped_files(
    repo_root: Path, tiny_bundle: Path, ref_dir: Path, tmp_path: Path
) -> None:
    """One perturbed log-prob row in a 1-case copy of llm.npz; the other fixture files are absent."""
    with np.load(ref_dir / "llm.npz") as ref:
        arrays = {k: ref[k] for k in ref.files if not k.startswith(("case1_", "case2_"))}
    arrays["case0_logp"] = arrays["case0_logp"].copy()
    arrays["case0_logp"][3, 17] += 1e-3
    np.savez(tmp_path / "llm.npz", **arrays)
    shutil.copy(ref_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    proc = run_cli(repo_root, "verify", "--bundle", tiny_bundle, "--fixtures", tmp_path, "--threads", "1")
    assert proc.returncode == 1
    logp_lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("llm") and "logp" in ln]
    assert len(logp_lines) == 1 and logp_lines[0].endswith("FAIL")  # case count derived from the arrays
    for name in ("flow.npz", "hift.npz", "stream.npz"):
        assert f"skipped   {name}: not present" in proc.stdout


def test_synth_clones_a_recording_on_the_cosyvoice2_bundle_at_24_khz(repo_root: Path, tmp_path: Path) -> None:
    bundle = repo_root / "models" / "tiny-cosyvoice2"
    prompt = repo_root / "tests" / "reference" / "tiny-cosyvoice2" / "prompts" / "en_24k.wav"
    common = ("synth", "--text", "你好，世界。", "--seed", "3", "--bundle", bundle, "--prompt-wav", prompt)
    outs = {name: tmp_path / f"{name}.wav" for name in ("zero_shot", "cross_lingual", "instruct2")}
    extra = {"zero_shot": ("--prompt-text", "Hello there."), "cross_lingual": (), "instruct2": ("--instruct", "用开心的语气说")}
    for name, out in outs.items():
        proc = run_cli(repo_root, *common, *extra[name], "--out", out)
        assert proc.returncode == 0, proc.stderr
    audio = {}
    for name, out in outs.items():
        params, audio[name] = read_wav(out)
        assert (params.nchannels, params.sampwidth, params.framerate) == (1, 2, 24000)
        assert np.abs(audio[name]).max() > 0
    # the transcript and the instruction reach the LLM: each mode gives other audio for the same seed
    assert len({a.tobytes() for a in audio.values()}) == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "no built-in speakers: clone a voice with --prompt-wav"),
        (("--speaker", "x", "--prompt-wav", "tests/reference/tiny-cosyvoice2/prompts/en_24k.wav"), "not both"),
        (("--prompt-wav", "service/cli.py"), "not a recording in a format"),
    ],
)
def test_bad_cosyvoice2_synth_input_exits_2_with_an_error_line(
    repo_root: Path, tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    out = tmp_path / "x.wav"
    proc = run_cli(
        repo_root, "synth", "--text", "你好", *args, "--out", out, "--bundle", repo_root / "models" / "tiny-cosyvoice2"
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
