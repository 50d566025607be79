"""The fixed noise of CosyVoice3's causal HiFT (SineGen2.sine_waves), which the official code draws from torch's
generator while the yaml loads and ships nowhere: the exporter reproduces the draws and the bundle states them as an
mt19937 position the runtime regenerates from (service/families/cosyvoice3/noise.py).

`set_all_random_seed(0)` in CausalConditionalCFM.__init__ reseeds the generator; what is drawn after it, in the yaml's
order, is the flow's rand_noise, the flow's own layers (input_embedding, spk_embed_affine_layer), the HiFT's f0
predictor, SineGen2.rand_ini and then sine_waves (cosyvoice/flow/flow_matching.py:196-200, cosyvoice/flow/flow.py:305-
311, cosyvoice/hifigan/generator.py:223-226). torch's CPU generator is an mt19937 whose float32 uniforms are the low 24
bits of one 32-bit draw each, and whose normals (16 or more values) take one uniform per value plus 16 more when the
count is not a multiple of 16; checked against the digests the official code's buffers have (tests/reference).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from export.cosyvoice3.config import CosyVoice3Config
from export.modules.flow import NOISE_FRAMES, NOISE_SEED

SINE_SAMPLES = 300 * 24000  # SineGen2.sine_waves: (1, 300 s x 24 kHz, harmonics)
_NORMAL_BLOCK = 16


def _normal_draws(n: int) -> int:
    """32-bit draws torch's CPU normal_ takes for `n` float32 values (n >= 16)."""
    return n + (_NORMAL_BLOCK if n % _NORMAL_BLOCK else 0)


def sine_noise_offset(cfg: CosyVoice3Config) -> int:
    """32-bit draws of the reseeded generator before SineGen2.sine_waves, for the sizes in `cfg`."""
    flow, f0 = cfg.flow, cfg.hift
    draws = _normal_draws(80 * NOISE_FRAMES)  # CausalConditionalCFM.rand_noise (randn)
    draws += _normal_draws(flow.vocab_size * flow.input_size)  # input_embedding (normal_)
    draws += flow.spk_embed_dim * flow.output_size + flow.output_size  # spk_embed_affine_layer (uniform)
    cond = f0.f0_cond_channels
    draws += f0.f0_in_channels * cond * 4 + cond  # f0 predictor: look-ahead conv (k4)
    draws += 4 * (cond * cond * 3 + cond)  # four causal convs (k3)
    draws += cond + 1  # classifier
    return draws + f0.nb_harmonics + 1  # SineGen2.rand_ini


def torch_sine_noise(cfg: CosyVoice3Config) -> torch.Tensor:
    """The buffer as the official code draws it: the same torch calls in the same order (SINE_SAMPLES, harmonics)."""
    flow, f0 = cfg.flow, cfg.hift
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(NOISE_SEED)  # set_all_random_seed(0): python's and numpy's seeds draw nothing here
        torch.randn([1, 80, NOISE_FRAMES])
        nn.Embedding(flow.vocab_size, flow.input_size)
        nn.Linear(flow.spk_embed_dim, flow.output_size)
        weight_norm(nn.Conv1d(f0.f0_in_channels, f0.f0_cond_channels, 4))
        for _ in range(4):
            weight_norm(nn.Conv1d(f0.f0_cond_channels, f0.f0_cond_channels, 3))
        nn.Linear(f0.f0_cond_channels, 1)
        torch.rand(1, f0.nb_harmonics + 1)
        return torch.rand(1, SINE_SAMPLES, f0.nb_harmonics + 1)[0]


def regenerated(seed: int, offset: int, values: int, block: int = 1 << 22) -> Iterator[np.ndarray]:
    """`values` float32 uniforms of mt19937 seeded as torch.manual_seed(seed) does, after `offset` 32-bit draws, in
    blocks of at most `block` values (the whole buffer at once would take 1.5 GB of intermediates)."""
    state = np.random.RandomState(seed).get_state()  # numpy's legacy seeding is torch's (init_genrand)
    bits = np.random.MT19937()
    bits.state = {"bit_generator": "MT19937", "state": {"key": state[1], "pos": state[2]}}
    bits.random_raw(offset, output=False)
    for start in range(0, values, block):
        raw = bits.random_raw(min(block, values - start))
        yield ((raw & 0xFFFFFF).astype(np.float64) * 2.0**-24).astype(np.float32)


def sha256_float32(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype="<f4").tobytes()).hexdigest()


def sine_noise_recipe(cfg: CosyVoice3Config) -> tuple[int, str]:
    """(offset, sha256 of the whole buffer), once mt19937 from that offset gave torch's buffer exactly (ValueError
    otherwise). This numpy regeneration is the exporter's own, independent of the runtime's."""
    want = torch_sine_noise(cfg).numpy().reshape(-1)
    offset, start = sine_noise_offset(cfg), 0
    for got in regenerated(NOISE_SEED, offset, want.size):
        if not np.array_equal(got, want[start : start + got.size]):
            raise ValueError(f"mt19937 from draw {offset} does not reproduce torch's SineGen2.sine_waves")
        start += got.size
    return offset, sha256_float32(want)
