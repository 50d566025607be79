"""HiFT vocoder (HiFTGenerator + ConvRNNF0Predictor) with the official `hift.pt` key names, as a torch reference."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from export.config import HiFTConfig

# Old torch.nn.utils.weight_norm leaf names -> parametrization API leaf names.
_LEGACY_WEIGHT_NORM = {
    "weight_g": "parametrizations.weight.original0",
    "weight_v": "parametrizations.weight.original1",
}
_GENERATOR_PREFIX = "generator."
_SNAKE_EPS = 1e-9
_MAGNITUDE_MAX = 100.0
_FINAL_LRELU_SLOPE = 0.01  # F.leaky_relu default, used once before conv_post


def normalize_hift_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip a `generator.` prefix and rename `weight_g`/`weight_v` to the parametrization names.

    Raises ValueError when two input keys map onto the same name (e.g. both weight-norm styles at once).
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        name = key.removeprefix(_GENERATOR_PREFIX)
        stem, _, leaf = name.rpartition(".")
        if leaf in _LEGACY_WEIGHT_NORM:
            name = f"{stem}.{_LEGACY_WEIGHT_NORM[leaf]}" if stem else _LEGACY_WEIGHT_NORM[leaf]
        if name in out:
            raise ValueError(f"hift state dict: '{key}' collides with another key as '{name}'")
        out[name] = value
    return out


def _padding(kernel_size: int, dilation: int = 1) -> int:
    return (kernel_size * dilation - dilation) // 2


class Snake(nn.Module):
    """Snake activation `x + sin²(αx) / (α + 1e-9)` with a per-channel α (linear scale); x is (B,C,T)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.unsqueeze(0).unsqueeze(-1)
        return x + (1.0 / (alpha + _SNAKE_EPS)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    """HiFi-GAN residual block: per dilation, Snake -> dilated WN conv -> Snake -> WN conv, plus the skip."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=_padding(kernel_size, d)))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel_size, padding=_padding(kernel_size))) for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for act1, conv1, act2, conv2 in zip(self.activations1, self.convs1, self.activations2, self.convs2, strict=True):
            x = conv2(act2(conv1(act1(x)))) + x
        return x


class ConvRNNF0Predictor(nn.Module):
    """Five WN Conv1d(k3) + ELU layers, a Linear to one value per frame, then abs: mel (B,C,T) -> f0 (B,T) Hz."""

    def __init__(self, in_channels: int, cond_channels: int, num_layers: int = 5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(num_layers):
            conv = nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, kernel_size=3, padding=1)
            layers += [weight_norm(conv), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        hidden = self.condnet(mel).transpose(1, 2)
        return torch.abs(self.classifier(hidden).squeeze(-1))


class SourceMerge(nn.Module):
    """The part of SourceModuleHnNSF that holds weights: `l_linear` (harmonics -> 1), followed by tanh."""

    def __init__(self, num_harmonics: int) -> None:
        super().__init__()
        self.l_linear = nn.Linear(num_harmonics, 1)

    def forward(self, sine: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l_linear(sine))


class HiFTGenerator(nn.Module):
    """HiFT (neural source filter + iSTFTNet) at inference, randomness injected by the caller.

    Submodule names follow the official `hift.pt`, so `load_official_state_dict` loads it with strict=True.
    """

    def __init__(self, cfg: HiFTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_harmonics = cfg.nb_harmonics + 1
        self.upsample_factor = math.prod(cfg.upsample_rates) * cfg.istft_hop_len
        self.num_bins = cfg.istft_n_fft // 2 + 1
        self.f0_predictor = ConvRNNF0Predictor(cfg.f0_in_channels, cfg.f0_cond_channels)
        self.m_source = SourceMerge(self.num_harmonics)
        self.conv_pre = weight_norm(nn.Conv1d(cfg.in_channels, cfg.base_channels, 7, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(self._channels(i), self._channels(i + 1), k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True))
        )
        self.source_downs = nn.ModuleList(self._source_downs())
        self.source_resblocks = nn.ModuleList(
            ResBlock(self._channels(i + 1), k, d)
            for i, (k, d) in enumerate(zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes, strict=True))
        )
        self.resblocks = nn.ModuleList(
            ResBlock(self._channels(i + 1), k, d)
            for i in range(len(cfg.upsample_rates))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True)
        )
        last = self._channels(len(cfg.upsample_rates))
        self.conv_post = weight_norm(nn.Conv1d(last, 2 * self.num_bins, 7, padding=3))
        self.reflection_pad = nn.ReflectionPad1d((1, 0))

    def _channels(self, level: int) -> int:
        return self.cfg.base_channels // (2**level)

    def _source_downs(self) -> list[nn.Conv1d]:
        """Bring the source STFT (64T+1 frames) to each upsampling level's length (8T, then 64T+1)."""
        rates = self.cfg.upsample_rates
        n_in = 2 * self.num_bins
        convs = []
        for i in range(len(rates)):
            rate = math.prod(rates[i + 1 :])  # source STFT frames per step at this level
            out = self._channels(i + 1)
            if rate == 1:
                convs.append(nn.Conv1d(n_in, out, 1))
            else:
                convs.append(nn.Conv1d(n_in, out, 2 * rate, rate, padding=rate // 2))
        return convs

    # ---- weights ---------------------------------------------------------------------------------

    def load_official_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load an official `hift.pt` dict (either weight-norm key style, optional `generator.` prefix), strictly."""
        if self.is_folded:
            raise RuntimeError("load_official_state_dict needs the weight-normed model (load before fold_weight_norm)")
        self.load_state_dict(normalize_hift_state_dict(state_dict), strict=True)

    @property
    def is_folded(self) -> bool:
        """True once no submodule carries a weight-norm parametrization."""
        return not any(parametrize.is_parametrized(m) for m in self.modules())

    def fold_weight_norm(self) -> None:
        """Bake g·v/‖v‖ into plain `weight` parameters (in place; idempotent). Do this after loading, before export."""
        for module in [m for m in self.modules() if parametrize.is_parametrized(m, "weight")]:
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)

    def folded_copy(self) -> HiFTGenerator:
        """A new eval-mode model with the same weights and weight norm folded; `self` is left untouched.

        (`copy.deepcopy` would share the parametrized classes, so folding a deep copy breaks the original.)
        """
        with torch.random.fork_rng(devices=[]):  # construction draws default inits; keep the caller's RNG
            twin = HiFTGenerator(self.cfg)
        if self.is_folded:
            twin.fold_weight_norm()
        twin.load_state_dict(self.state_dict(), strict=True)
        twin.fold_weight_norm()
        return twin.eval()

    # ---- f0 and source ---------------------------------------------------------------------------

    def f0(self, mel: torch.Tensor) -> torch.Tensor:
        """mel (B,80,T) float32 -> f0 (B,T) in Hz."""
        return self.f0_predictor(mel)

    def sine_waves(self, f0: torch.Tensor, phase: torch.Tensor, sine_noise: torch.Tensor) -> torch.Tensor:
        """SineGen with injected randomness: f0 (B,T) Hz, phase (B,H,1) rad (harmonic 0 is zero), noise (B,H,L).

        Returns the noisy harmonic stack (B,L,H), L = 256·T, H = nb_harmonics + 1. The phase accumulation
        is summed in float64 and rounded to float32 per sample, which is what torch's CPU cumsum does.
        """
        f0_up = torch.repeat_interleave(f0.unsqueeze(1), self.upsample_factor, dim=-1)  # (B,1,L)
        rate = self.cfg.sampling_rate
        cycles = torch.cat([f0_up * (h + 1) / rate for h in range(self.num_harmonics)], dim=1)
        accumulated = torch.cumsum(cycles.double(), dim=-1).float()
        theta = 2 * math.pi * (accumulated % 1)
        amp = self.cfg.nsf_alpha
        sine = amp * torch.sin(theta + phase)
        uv = (f0_up > self.cfg.nsf_voiced_threshold).float()
        noise_amp = uv * self.cfg.nsf_sigma + (1 - uv) * amp / 3
        return (sine * uv + noise_amp * sine_noise).transpose(1, 2)

    def merge_source(self, sine: torch.Tensor) -> torch.Tensor:
        """Harmonic stack (B,L,H) -> excitation source (B,1,L) = tanh(l_linear(sine)) transposed."""
        return self.m_source(sine).transpose(1, 2)

    def source_from_f0(self, f0: torch.Tensor, phase: torch.Tensor, sine_noise: torch.Tensor) -> torch.Tensor:
        """f0 (B,T) Hz plus injected phase (B,H,1) and noise (B,H,L) -> source (B,1,L)."""
        return self.merge_source(self.sine_waves(f0, phase, sine_noise))

    # ---- decode ----------------------------------------------------------------------------------

    def window(self) -> torch.Tensor:
        """Periodic Hann window of n_fft samples, computed in float64 and rounded like scipy's float32 cast."""
        return torch.hann_window(self.cfg.istft_n_fft, periodic=True, dtype=torch.float64).float()

    def stft(self, source: torch.Tensor) -> torch.Tensor:
        """source (B,1,L) -> s_stft (B,18,L/hop+1) = [Re ; Im] of the centred, reflect-padded STFT."""
        n_fft, hop = self.cfg.istft_n_fft, self.cfg.istft_hop_len
        spec = torch.stft(source.squeeze(1), n_fft, hop, n_fft, window=self.window(), return_complex=True)
        return torch.cat([spec.real, spec.imag], dim=1)

    def conv_decode(self, mel: torch.Tensor, s_stft: torch.Tensor) -> torch.Tensor:
        """mel (B,80,T) and s_stft (B,18,64T+1) -> conv_post output (B,18,64T+1): log-magnitude ; phase."""
        x = self.conv_pre(mel)
        kernels = len(self.cfg.resblock_kernel_sizes)
        for i, (up, down, source_block) in enumerate(zip(self.ups, self.source_downs, self.source_resblocks, strict=True)):
            x = up(F.leaky_relu(x, self.cfg.lrelu_slope))
            if i == len(self.ups) - 1:
                x = self.reflection_pad(x)
            x = x + source_block(down(s_stft))
            blocks = self.resblocks[i * kernels : (i + 1) * kernels]
            total = blocks[0](x)
            for block in blocks[1:]:
                total = total + block(x)
            x = total / kernels
        return self.conv_post(F.leaky_relu(x, _FINAL_LRELU_SLOPE))

    def istft(self, x: torch.Tensor) -> torch.Tensor:
        """conv_post output (B,18,F) -> waveform (B,hop·(F-1)): exp/clip magnitude, sin phase, iSTFT, clamp."""
        n_fft, hop = self.cfg.istft_n_fft, self.cfg.istft_hop_len
        magnitude = torch.clip(torch.exp(x[:, : self.num_bins]), max=_MAGNITUDE_MAX)
        phase = torch.sin(x[:, self.num_bins :])
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        wav = torch.istft(spec, n_fft, hop, n_fft, window=self.window())
        return torch.clamp(wav, -self.cfg.audio_limit, self.cfg.audio_limit)

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """mel (B,80,T) and source (B,1,256T) -> waveform (B,256T) float32 in [-audio_limit, audio_limit]."""
        return self.istft(self.conv_decode(mel, self.stft(source)))
