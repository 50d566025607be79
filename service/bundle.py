"""Model bundle: the manifest schema shared with export/, and ModelBundle.load() for the runtime."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from service.errors import BundleError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SPEAKERS_NAME = "speakers.json"
TOKENIZER_NAME = "multilingual.tiktoken"

# Graph name -> (input names, output names). `{i}` expands to one name per LLM layer.
GRAPH_IO: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llm_encoder": (("text_ids", "embedding"), ("lm_input",)),
    "llm_embed": (("token",), ("x",)),
    "llm_pos": (("pe",), ("pos",)),
    "llm_step": (("x", "past_len", "past_k_{i}", "past_v_{i}", "pos_{i}"), ("logp", "new_k", "new_v")),
    "flow_encoder": (("tokens", "embedding"), ("h", "spks")),
    "flow_lr": (("x",), ("mu",)),
    "flow_estimator": (("x", "mask", "mu", "t", "spks", "cond"), ("v",)),
    "hift_f0": (("mel",), ("f0",)),
    "hift_source": (("sine",), ("source",)),
    "hift_decode": (("mel", "s_stft"), ("x",)),
}
GRAPH_NAMES: tuple[str, ...] = tuple(GRAPH_IO)

# The optional "prompt" group: the official prompt-analysis models, copied verbatim from the checkpoint directory
# (CAM++ speaker embedding, S3 speech tokenizer v1). Graph name -> (file name, input names, output names).
PROMPT_GRAPHS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "campplus": ("campplus.onnx", ("input",), ("output",)),
    "speech_tokenizer": ("speech_tokenizer_v1.onnx", ("feats", "feats_length"), ("indices",)),
}
PROMPT_GRAPH_NAMES: tuple[str, ...] = tuple(PROMPT_GRAPHS)
GROUP_CORE = "core"
GROUP_PROMPT = "prompt"
# The optional "float" group: twins of core graphs that a quantized bundle computes in int8, computing in floating
# point instead, for runtimes that compute in bf16 (OpenVINO). A twin is named `<core name>_float`, has the core
# graph's inputs and outputs, and keeps its weights compressed (precision "int8-weights": int8 MatMul weights behind
# DequantizeLinear, other weights float16 behind Cast; export/quantize.py float_twin).
GROUP_FLOAT = "float"
FLOAT_SUFFIX = "_float"

FAMILY_V1 = "cosyvoice1"  # CosyVoice-300M (-SFT, -Instruct); a manifest without `family` is one
FAMILY_V2 = "cosyvoice2"  # CosyVoice2-0.5B
V2_TOKENIZER_NAME = "tokenizer.json"  # the Qwen2 byte-level BPE with CosyVoice's special tokens (`tokenizers` format)
V2_NOISE_NAME = "flow_noise.npy"  # the flow's fixed noise buffer (80, 15000) float32 (official rand_noise)
# CosyVoice2 graphs. Templates: `{i}` one name per LLM layer, `{e}` per token-rate encoder block, `{u}` per
# up-sampled encoder block, `{b}` per estimator transformer block (counts in manifest.cosyvoice2 / constants).
V2_GRAPH_IO: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llm_prompt": (("text_ids",), ("x",)),
    "llm_embed": (("token",), ("x",)),
    "llm_step": (("x", "past_len", "past_k_{i}", "past_v_{i}"), ("logp", "new_k", "new_v")),
    "flow_speaker": (("embedding",), ("spks",)),
    "flow_encoder": (
        ("tokens", "context", "chunk", "look_ahead", "up_tail", "enc_k_{e}", "enc_v_{e}", "up_k_{u}", "up_v_{u}"),
        ("h", "look_ahead_out", "up_tail_out", "enc_new_k", "enc_new_v", "up_new_k", "up_new_v"),
    ),
    "flow_estimator": (
        ("x", "mu", "t", "spks", "cond", "chunk", "tails", "past_k_{b}", "past_v_{b}"),
        ("v", "tails_out", "new_k", "new_v"),
    ),
    "hift_f0": GRAPH_IO["hift_f0"],
    "hift_source": GRAPH_IO["hift_source"],
    "hift_decode": GRAPH_IO["hift_decode"],
}
# CosyVoice2 prompt models: the same CAM++ and a 25 Hz speech tokenizer (inputs feats, feats_length; output indices).
V2_PROMPT_GRAPHS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "campplus": PROMPT_GRAPHS["campplus"],
    "speech_tokenizer": ("speech_tokenizer_v2.onnx", ("feats", "feats_length"), ("indices",)),
}


@dataclass(frozen=True)
class FamilyLayout:
    """What a bundle of one model family holds: its core graphs, prompt models and other required files."""

    graph_io: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]
    prompt_graphs: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]]
    tokenizer: str
    required_files: tuple[str, ...]


FAMILIES: dict[str, FamilyLayout] = {
    FAMILY_V1: FamilyLayout(GRAPH_IO, PROMPT_GRAPHS, TOKENIZER_NAME, (SPEAKERS_NAME, TOKENIZER_NAME)),
    FAMILY_V2: FamilyLayout(V2_GRAPH_IO, V2_PROMPT_GRAPHS, V2_TOKENIZER_NAME, (SPEAKERS_NAME, V2_TOKENIZER_NAME, V2_NOISE_NAME)),
}


def family_layout(family: str) -> FamilyLayout:
    """The layout of a known family; BundleError naming the known ones otherwise."""
    if family not in FAMILIES:
        raise BundleError(f"manifest family {family!r} is not known (known: {', '.join(FAMILIES)})")
    return FAMILIES[family]


def expand_io_names(names: tuple[str, ...], num_layers: int, counts: dict[str, int] | None = None) -> list[str]:
    """Expand `{i}` templates into per-layer names, grouped by template (all past_k, then past_v, ...).

    `counts` gives the number of names for other one-letter templates (CosyVoice2: `{e}`, `{u}`, `{b}`).
    """
    sizes = {"i": num_layers, **(counts or {})}
    out: list[str] = []
    for name in names:
        key = next((k for k in sizes if "{" + k + "}" in name), None)
        if key is None:
            out.append(name)
        else:
            out.extend(name.replace("{" + key + "}", str(n)) for n in range(sizes[key]))
    return out


def relative_pe(rows: int, dim: int) -> np.ndarray:
    """Positional rows of the bundle contract: espnet sinusoids (rows, dim) float32 for relative distances 0..rows-1.

    Row r: `pe[r, 2j] = sin(r * w_j)`, `pe[r, 2j+1] = cos(r * w_j)`, `w_j = exp(2j * -(ln(10000)/dim))`; angles are
    float32 products as in torch. The exp is taken in float64 and rounded to float32: that equals torch's float32 exp
    on all but 2-3 of 512 frequencies (numpy's float32 exp differs on ~200), so pe stays within 4e-6 of torch for
    r < 100 and 3e-5 for r < 1000. The exporter (llm_pos inputs) and the engine build rows with this one function.
    """
    if dim % 2:
        raise ValueError(f"positional dimension must be even, got {dim}")
    exponent = np.arange(0, dim, 2, dtype=np.float32) * np.float32(-(math.log(10000.0) / dim))
    w = np.exp(exponent.astype(np.float64)).astype(np.float32)
    angle = np.arange(rows, dtype=np.float32)[:, None] * w[None, :]
    pe = np.empty((rows, dim), dtype=np.float32)
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle)
    return pe


@dataclass(frozen=True)
class ModelConstants:
    """Every model fact the runtime needs; sizes come from the checkpoint's cosyvoice.yaml."""

    sample_rate: int = 22050
    token_rate_hz: int = 50
    mel_hop_samples: int = 256
    n_mels: int = 80
    spk_embed_dim: int = 192
    text_vocab_size: int = 51866
    speech_token_size: int = 4096
    eos_token: int = 4096
    # LLM decoder geometry (for the KV cache)
    llm_num_layers: int = 14
    llm_num_heads: int = 16
    llm_head_dim: int = 64
    llm_model_dim: int = 1024
    # sampling (ras_sampling)
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    # flow matching
    n_timesteps: int = 10
    cfg_rate: float = 0.7
    t_scheduler: str = "cosine"
    temperature: float = 1.0
    # HiFT
    nb_harmonics: int = 8
    sine_amp: float = 0.1
    noise_std: float = 0.003
    voiced_threshold_hz: float = 10.0
    istft_n_fft: int = 16
    istft_hop: int = 4
    audio_limit: float = 0.99
    upsample_rates: tuple[int, ...] = (8, 8)
    # v1 streaming orchestration
    token_hop_len: int = 100
    token_max_hop_len: int = 200
    token_overlap_len: int = 20
    mel_cache_len: int = 20
    stream_scale_factor: float = 1.0

    @property
    def mel_overlap_len(self) -> int:
        """Mel frames produced by `token_overlap_len` tokens (34 for the official config)."""
        return self.tokens_to_mel_frames(self.token_overlap_len)

    @property
    def source_cache_len(self) -> int:
        """Samples of HiFT source kept between chunks (mel_cache_len * samples per mel frame)."""
        return self.mel_cache_len * self.mel_hop_samples

    def tokens_to_mel_frames(self, n_tokens: int) -> int:
        """Official conversion `int(n / token_rate * sample_rate / hop)` (floors)."""
        return int(n_tokens / self.token_rate_hz * self.sample_rate / self.mel_hop_samples)


@dataclass(frozen=True)
class CosyVoice2Constants:
    """CosyVoice2 facts beyond ModelConstants: stop tokens, the flow's chunk geometry and its cache shapes.

    In a CosyVoice2 manifest ModelConstants reads: llm_num_heads = the LLM's K/V heads (grouped-query attention),
    token_hop_len / token_max_hop_len / stream_scale_factor = the streaming hop schedule (25, 100, 2), mel_cache_len
    = the vocoder's mel overlap (8 frames), token_overlap_len = 0 (no flow overlap: the flow keeps caches).
    """

    stop_tokens: int = 3  # speech_token_size + 0..2 all end the utterance
    text_vocab_size: int = 151936
    chunk_tokens: int = 25  # static_chunk_size: attention chunk of the encoder (x token_mel_ratio for the estimator)
    token_mel_ratio: int = 2
    pre_lookahead: int = 3  # tokens of look-ahead the encoder reads past a chunk
    encoder_blocks: int = 6
    up_blocks: int = 4
    encoder_heads: int = 8
    encoder_head_dim: int = 64
    encoder_dim: int = 512
    conv_tail: int = 2  # left context kept by every causal convolution
    estimator_blocks: int = 56
    estimator_heads: int = 8
    estimator_head_dim: int = 64
    estimator_tail_channels: int = 8256  # sum of the estimator's causal-conv input channels (the `tails` input)
    noise_frames: int = 15000

    def graph_counts(self) -> dict[str, int]:
        """Template counts of V2_GRAPH_IO besides `{i}`."""
        return {"e": self.encoder_blocks, "u": self.up_blocks, "b": self.estimator_blocks}


@dataclass(frozen=True)
class GraphEntry:
    """One ONNX graph of the bundle."""

    file: str
    sha256: str
    precision: str  # "fp32", "int8", "int4" (4-bit weight-only MatMulNBits) or "int8-weights" (a float twin)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    opset: int = 13
    group: str = GROUP_CORE  # "core" (written by our exporter) or "prompt" (copied from the checkpoint)


@dataclass(frozen=True)
class Capabilities:
    """What a bundle can voice. The defaults are what a manifest without this key (an older bundle) means."""

    builtin_speakers: bool = True  # speakers.json lists speakers (SFT and instruct need one)
    prompt_analysis: bool = False  # the prompt group is present: voices from prompt audio (zero-shot, cross-lingual)
    instruct: bool = False  # trained for instruct text in front of the LLM text (CosyVoice-300M-Instruct)
    instruct2: bool = False  # an instruction in front of the text with a cloned voice (CosyVoice2 inference_instruct2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Capabilities:
        """Parse `manifest.capabilities`; absent keys take the defaults above, unknown keys are refused."""
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise BundleError(f"manifest capabilities has unknown key(s) {', '.join(unknown)}")
        legacy = cls()
        return cls(**{f.name: _flag(data, f.name, getattr(legacy, f.name)) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class Manifest:
    """The bundle's manifest.json."""

    format_version: int
    model: str
    precision: str
    constants: ModelConstants
    graphs: dict[str, GraphEntry]
    source_files: dict[str, str] = field(default_factory=dict)  # checkpoint file name -> sha256
    files: dict[str, str] = field(default_factory=dict)  # bundle file (non-graph) -> sha256
    exporter: dict[str, str] = field(default_factory=dict)  # tool versions, random_init, seed
    random_weights: bool = False  # the weights were not trained: the audio is noise
    test_model: bool = False  # a miniature model for tests and CI, not for speech
    description: str = ""  # one sentence for people: what this model is
    capabilities: Capabilities = field(default_factory=Capabilities)
    family: str = FAMILY_V1  # the model family (its graphs and engine); absent from v1 manifests
    cosyvoice2: CosyVoice2Constants | None = None  # CosyVoice2 only

    @property
    def layout(self) -> FamilyLayout:
        return family_layout(self.family)

    def graphs_in(self, group: str) -> dict[str, GraphEntry]:
        """The graphs of one group ("core", "prompt" or "float"), in manifest order."""
        return {n: g for n, g in self.graphs.items() if g.group == group}

    @property
    def warning(self) -> str | None:
        """What to tell a user of a model whose audio is noise (None for a trained model)."""
        if not (self.random_weights or self.test_model):
            return None
        kind = "a test model" if self.test_model else "a benchmark model"
        return (
            f"{self.model} is {kind} with random weights: its audio is noise, not speech. "
            "Export and serve an official CosyVoice checkpoint for real speech (README: Serving the real model)."
        )

    def to_json(self) -> str:
        """Serialize deterministically (sorted keys, no timestamps) so exports are reproducible.

        Keys added for CosyVoice2 are left out at their v1 values, so a v1 manifest keeps its bytes.
        """
        data = dataclasses.asdict(self)
        if data["family"] == FAMILY_V1:
            del data["family"]
        if data["cosyvoice2"] is None:
            del data["cosyvoice2"]
        if not data["capabilities"]["instruct2"]:
            del data["capabilities"]["instruct2"]
        return json.dumps(data, ensure_ascii=False, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """Parse and validate a manifest dict; raises BundleError naming what is wrong."""
        try:
            version = int(data["format_version"])
            if version != FORMAT_VERSION:
                raise BundleError(f"manifest format_version {version} is not supported (expected {FORMAT_VERSION})")
            consts = dict(data["constants"])
            consts["upsample_rates"] = tuple(consts.get("upsample_rates", (8, 8)))
            graphs = {
                name: GraphEntry(**{**g, "inputs": tuple(g["inputs"]), "outputs": tuple(g["outputs"])})
                for name, g in data["graphs"].items()
            }
            manifest = cls(
                format_version=version,
                model=str(data["model"]),
                precision=str(data["precision"]),
                constants=ModelConstants(**consts),
                graphs=graphs,
                source_files=dict(data.get("source_files", {})),
                files=dict(data.get("files", {})),
                exporter=dict(data.get("exporter", {})),
                # bundles written before these keys existed say it in exporter.random_init
                random_weights=_flag(data, "random_weights", data.get("exporter", {}).get("random_init") == "true"),
                test_model=_flag(data, "test_model"),
                description=str(data.get("description", "")),
                capabilities=Capabilities.from_dict(dict(data.get("capabilities", {}))),
                family=str(data.get("family", FAMILY_V1)),
                cosyvoice2=CosyVoice2Constants(**data["cosyvoice2"]) if data.get("cosyvoice2") is not None else None,
            )
            family_layout(manifest.family)
            if (manifest.family == FAMILY_V2) != (manifest.cosyvoice2 is not None):
                raise BundleError("manifest key 'cosyvoice2' must be present exactly when family is 'cosyvoice2'")
        except BundleError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(f"manifest is malformed: {type(e).__name__}: {e}") from e
        _check_groups(manifest)
        return manifest


def _check_groups(manifest: Manifest) -> None:
    """Graph groups agree with the table above and with the declared capabilities."""
    prompt_graphs = manifest.layout.prompt_graphs
    for name, g in manifest.graphs.items():
        want = GROUP_PROMPT if name in prompt_graphs else GROUP_FLOAT if _is_float_twin(name) else GROUP_CORE
        if g.group != want:
            raise BundleError(f"manifest graph {name!r} is in group {g.group!r}, expected {want!r}")
        core = manifest.graphs.get(name.removesuffix(FLOAT_SUFFIX)) if want == GROUP_FLOAT else None
        if core is not None and (g.inputs, g.outputs) != (core.inputs, core.outputs):
            raise BundleError(f"manifest graph {name!r} must have the inputs and outputs of its core graph")
    caps, prompt = manifest.capabilities, manifest.graphs_in(GROUP_PROMPT)
    if caps.prompt_analysis:
        missing = [n for n in prompt_graphs if n not in prompt]
        if missing:
            raise BundleError(f"manifest declares prompt_analysis but lists no graph for {', '.join(missing)}")
        for name, (_, inputs, outputs) in prompt_graphs.items():
            if (prompt[name].inputs, prompt[name].outputs) != (inputs, outputs):
                raise BundleError(
                    f"manifest graph {name!r} has inputs {list(prompt[name].inputs)} / outputs "
                    f"{list(prompt[name].outputs)}, expected {list(inputs)} / {list(outputs)}"
                )
    elif prompt:
        raise BundleError(f"manifest lists prompt graphs ({', '.join(prompt)}) but does not declare prompt_analysis")
    if caps.instruct and not caps.builtin_speakers:
        raise BundleError("manifest declares instruct without builtin_speakers (instruct voices a built-in speaker)")
    if caps.instruct2 and not caps.prompt_analysis:
        raise BundleError("manifest declares instruct2 without prompt_analysis (instruct2 voices a prompt recording)")
    if not (caps.builtin_speakers or caps.prompt_analysis):
        raise BundleError("manifest declares neither builtin_speakers nor prompt_analysis: the model has no voice")


def _is_float_twin(name: str) -> bool:
    return name.endswith(FLOAT_SUFFIX) and name.removesuffix(FLOAT_SUFFIX) in GRAPH_IO


def _flag(data: dict[str, Any], key: str, default: bool = False) -> bool:
    """A boolean manifest key (absent = `default`); anything but true/false is a malformed manifest."""
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise BundleError(f"manifest key {key!r} must be true or false, got {value!r}")
    return value


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_speakers(path: Path) -> dict[str, np.ndarray]:
    """Speaker table: name -> raw float32 x-vector of shape (spk_embed_dim,), in file order."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return {s["name"]: np.asarray(s["embedding"], dtype=np.float32) for s in data["speakers"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BundleError(f"{path}: cannot read speaker table: {e}") from e


def write_speakers(path: Path, speakers: dict[str, np.ndarray]) -> None:
    """Write the speaker table as JSON (float32 values round-trip exactly)."""
    rows = [{"name": n, "embedding": [float(x) for x in np.asarray(e, np.float32).reshape(-1)]} for n, e in speakers.items()]
    path.write_text(json.dumps({"speakers": rows}, ensure_ascii=False) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class ModelBundle:
    """A validated bundle on disk: manifest, graph paths, speakers and tokenizer file."""

    root: Path
    manifest: Manifest
    speakers: dict[str, np.ndarray]

    @property
    def constants(self) -> ModelConstants:
        return self.manifest.constants

    @property
    def family(self) -> str:
        return self.manifest.family

    @property
    def tokenizer_path(self) -> Path:
        return self.root / self.manifest.layout.tokenizer

    @property
    def manifest_sha256(self) -> str:
        """Identity of the bundle (used in cache keys)."""
        return sha256_file(self.root / MANIFEST_NAME)

    @property
    def capabilities(self) -> Capabilities:
        return self.manifest.capabilities

    @property
    def has_prompt_analysis(self) -> bool:
        """True when the prompt models (campplus, speech_tokenizer) are in the bundle: voices from prompt audio."""
        return self.manifest.capabilities.prompt_analysis

    def graph_path(self, name: str) -> Path:
        return self.root / self.manifest.graphs[name].file

    def float_graph_path(self, name: str) -> Path | None:
        """A floating-point form of core graph `name`: the graph itself when it is fp32, else its float twin (group
        "float"), else None (a quantized graph without a twin)."""
        entry = self.manifest.graphs[name]
        if entry.precision == "fp32":
            return self.graph_path(name)
        twin = name + FLOAT_SUFFIX
        return self.graph_path(twin) if twin in self.manifest.graphs else None

    def prompt_model_path(self, name: str) -> Path:
        """Path of a prompt model ("campplus" or "speech_tokenizer"); BundleError if the bundle has none."""
        prompt_graphs = self.manifest.layout.prompt_graphs
        if name not in prompt_graphs:
            raise BundleError(f"unknown prompt model {name!r} (known: {', '.join(prompt_graphs)})")
        if not self.has_prompt_analysis:
            raise BundleError(f"{self.root}: the bundle has no prompt models (exported without {prompt_graphs[name][0]})")
        return self.graph_path(name)

    @classmethod
    def load(cls, path: str | Path, *, verify_hashes: bool = False) -> ModelBundle:
        """Read and validate a bundle directory; raises BundleError with one clear message."""
        root = Path(path)
        mpath = root / MANIFEST_NAME
        if not root.is_dir():
            raise BundleError(f"{root}: not a directory (expected a model bundle)")
        if not mpath.is_file():
            raise BundleError(f"{root}: not a model bundle ({MANIFEST_NAME} is missing)")
        try:
            data = json.loads(mpath.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise BundleError(f"{mpath}: cannot parse: {e}") from e
        manifest = Manifest.from_dict(data)
        _check_files(root, manifest, verify_hashes)
        speakers = _checked_speakers(root / SPEAKERS_NAME, manifest)
        return cls(root=root, manifest=manifest, speakers=speakers)


def _checked_speakers(path: Path, manifest: Manifest) -> dict[str, np.ndarray]:
    """The speaker table, which must agree with capabilities.builtin_speakers (empty exactly when it is false)."""
    speakers = read_speakers(path)
    dim = manifest.constants.spk_embed_dim
    bad = [n for n, e in speakers.items() if e.shape != (dim,)]
    if bad:
        raise BundleError(f"{path}: expected speakers with {dim}-d embeddings, bad: {bad}")
    declared = manifest.capabilities.builtin_speakers
    if declared != bool(speakers):
        listed = f"lists {len(speakers)} speaker(s)" if speakers else "lists no speakers"
        raise BundleError(f"{path}: {listed} but the manifest declares builtin_speakers={str(declared).lower()}")
    return speakers


def _check_files(root: Path, manifest: Manifest, verify_hashes: bool) -> None:
    """Every core graph listed, every listed file (graphs of both groups, speakers, tokenizer) present and hashed."""
    layout = manifest.layout
    missing_graphs = [g for g in layout.graph_io if g not in manifest.graphs]
    if missing_graphs:
        raise BundleError(f"{root}: manifest lists no graph for {', '.join(missing_graphs)}")
    expected = {g.file: g.sha256 for g in manifest.graphs.values()} | manifest.files
    for required in layout.required_files:
        expected.setdefault(required, "")
    missing = sorted(f for f in expected if not (root / f).is_file())
    if missing:
        raise BundleError(f"{root}: bundle is incomplete, missing {', '.join(missing)}")
    if verify_hashes:
        bad = sorted(f for f, h in expected.items() if h and sha256_file(root / f) != h)
        if bad:
            raise BundleError(f"{root}: sha256 mismatch for {', '.join(bad)}")
