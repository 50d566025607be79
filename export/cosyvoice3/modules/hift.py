"""CausalHiFTGenerator (the Fun-CosyVoice3 vocoder) with the official `hift.pt` key names, as a torch reference.

Every convolution is causal (zero padding on the left; conv_pre and the f0 predictor's first conv on the right, their
look-ahead), so a call over a longer mel gives the same earlier samples: the runtime streams it over a bounded window.
The f0 predictor runs in float64 as the official does (`CausalHiFTGenerator.inference`), written as time-first
products so that ONNX Runtime, which has no float64 convolution, runs it in float64 too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from export.config import HiFTConfig
from export.modules.hift import Snake, SourceMerge

_FINAL_LRELU_SLOPE = 0.01  # F.leaky_relu default, used once before conv_post
_MAGNITUDE_MAX = 100.0


def causal_padding(kernel: int, dilation: int = 1) -> int:
    """The official CausalConv1d's padding: (k - 1) x dilation for odd kernels, k - 1 for even ones."""
    return int((kernel * dilation - dilation) / 2) * 2 + (kernel + 1) % 2


class CausalConv(nn.Conv1d):
    """Official CausalConv1d: zeros on the left (or, `right`, on the right: a look-ahead convolution)."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, *, right: bool = False) -> None:
        super().__init__(cin, cout, kernel, dilation=dilation)
        self.pad, self.right = causal_padding(kernel, dilation), right

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (0, self.pad) if self.right else (self.pad, 0)))


class CausalDown(nn.Conv1d):
    """Official CausalConv1dDownSample: kernel 2u, stride u, u - 1 zeros on the left."""

    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__(cin, cout, 2 * rate, rate)
        self.pad = rate - 1

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.pad, 0)))


class CausalUp(nn.Conv1d):
    """Official CausalConv1dUpsample: nearest x rate, then kernel - 1 zeros on the left and a stride-1 conv."""

    def __init__(self, cin: int, cout: int, kernel: int, rate: int) -> None:
        super().__init__(cin, cout, kernel)
        self.rate = rate

    def forward(self, x: Tensor) -> Tensor:
        up = torch.repeat_interleave(x, self.rate, dim=2)
        return super().forward(F.pad(up, (self.kernel_size[0] - 1, 0)))


class CausalResBlock(nn.Module):
    """Official ResBlock(causal=True): per dilation, Snake -> dilated causal WN conv -> Snake -> causal WN conv, + skip."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(weight_norm(CausalConv(channels, channels, kernel, d)) for d in dilations)
        self.convs2 = nn.ModuleList(weight_norm(CausalConv(channels, channels, kernel)) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:
        for act1, conv1, act2, conv2 in zip(self.activations1, self.convs1, self.activations2, self.convs2, strict=True):
            x = conv2(act2(conv1(act1(x)))) + x
        return x


class CausalF0Predictor(nn.Module):
    """Official CausalConvRNNF0Predictor: a look-ahead conv (k4, 3 frames right), four causal k3 convs, ELU after each,
    a Linear to one value per frame, abs. Keys condnet.{0,2,4,6,8}, classifier."""

    LAYERS = 5

    def __init__(self, in_channels: int, cond_channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [weight_norm(CausalConv(in_channels, cond_channels, 4, right=True)), nn.ELU()]
        for _ in range(self.LAYERS - 1):
            layers += [weight_norm(CausalConv(cond_channels, cond_channels, 3)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def convs(self) -> list[CausalConv]:
        return [m for m in self.condnet if isinstance(m, CausalConv)]

    def forward(self, mel: Tensor) -> Tensor:
        """The official conv form in the module's precision: mel (B,80,T) -> f0 (B,T)."""
        return torch.abs(self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1))

    def time_first(self, mel: Tensor) -> Tensor:
        """The same in float64 as ONNX Runtime can run it: each conv one product over its kernel's frames side by side,
        ELU as exp(x) - 1 below 0. mel (B,80,T) float32 -> f0 (B,T) float64."""
        x = mel.double().transpose(1, 2)
        for conv in self.convs():
            k = conv.kernel_size[0]
            padded = F.pad(x, (0, 0, 0, conv.pad) if conv.right else (0, 0, conv.pad, 0))
            stacked = torch.cat([padded[:, j : (j - k + 1) or None] for j in range(k)], dim=2)
            weight = conv.weight.double().permute(0, 2, 1).reshape(conv.out_channels, k * conv.in_channels)
            x = F.linear(stacked, weight, conv.bias.double())  # type: ignore[union-attr]
            x = torch.where(x > 0, x, torch.exp(x) - 1.0)
        return torch.abs(F.linear(x, self.classifier.weight.double(), self.classifier.bias.double()).squeeze(-1))


class CausalHiFT(nn.Module):
    """CausalHiFTGenerator at inference, randness injected by the caller (the runtime draws from the official buffers).

    `conv_decode` is `decode` with finalize=True up to conv_post (its look-ahead frames are zeros); a non-final call is
    the same over more frames with the last ones cut (export/cosyvoice3 docs: the official finalize=False equals it).
    """

    def __init__(self, cfg: HiFTConfig, conv_pre_look_right: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_harmonics = cfg.nb_harmonics + 1
        self.upsample_factor = math.prod(cfg.upsample_rates) * cfg.istft_hop_len
        self.num_bins = cfg.istft_n_fft // 2 + 1
        self.m_source = SourceMerge(self.num_harmonics)
        base = cfg.base_channels
        self.conv_pre = weight_norm(CausalConv(cfg.in_channels, base, conv_pre_look_right + 1, right=True))
        rates, kernels = cfg.upsample_rates, cfg.upsample_kernel_sizes
        self.ups = nn.ModuleList(
            weight_norm(CausalUp(base // 2**i, base // 2 ** (i + 1), k, u))
            for i, (u, k) in enumerate(zip(rates, kernels, strict=True))
        )
        down = [1, *rates[::-1][:-1]]
        cum = [math.prod(down[: i + 1]) for i in range(len(down))][::-1]
        n_in = cfg.istft_n_fft + 2
        self.source_downs = nn.ModuleList(
            CausalConv(n_in, base // 2 ** (i + 1), 1) if u == 1 else CausalDown(n_in, base // 2 ** (i + 1), u)
            for i, u in enumerate(cum)
        )
        self.source_resblocks = nn.ModuleList(
            CausalResBlock(base // 2 ** (i + 1), k, d)
            for i, (k, d) in enumerate(zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes, strict=True))
        )
        self.resblocks = nn.ModuleList(
            CausalResBlock(base // 2 ** (i + 1), k, d)
            for i in range(len(rates))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = weight_norm(CausalConv(base // 2 ** len(rates), n_in, 7))
        self.reflection_pad = nn.ReflectionPad1d((1, 0))
        self.f0_predictor = CausalF0Predictor(cfg.f0_in_channels, cfg.f0_cond_channels)
        self.conv_pre_look_right = conv_pre_look_right

    # ---- weights ---------------------------------------------------------------------------------

    def fold_weight_norm(self) -> None:
        """Bake g·v/‖v‖ into plain `weight` parameters (in place; idempotent). After loading, before export."""
        for module in [m for m in self.modules() if parametrize.is_parametrized(m, "weight")]:
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)

    def folded_copy(self) -> CausalHiFT:
        """A new eval-mode model with the same weights and weight norm folded; `self` is left untouched."""
        with torch.random.fork_rng(devices=[]):
            twin = CausalHiFT(self.cfg, self.conv_pre_look_right)
        if not any(parametrize.is_parametrized(m) for m in self.modules()):
            twin.fold_weight_norm()
        twin.load_state_dict(self.state_dict(), strict=True)
        twin.fold_weight_norm()
        return twin.eval()

    # ---- f0 and source ---------------------------------------------------------------------------

    def f0(self, mel: Tensor) -> Tensor:
        """mel (B,80,T) float32 -> f0 (B,T) float64 in Hz, finalize=True (the last 3 frames see zeros after them)."""
        return self.f0_predictor.time_first(mel)

    def merge_source(self, sine: Tensor) -> Tensor:
        """Harmonic stack (B,L,H) -> excitation source (B,1,L) = tanh(l_linear(sine)) transposed."""
        return self.m_source(sine).transpose(1, 2)

    # ---- decode ----------------------------------------------------------------------------------

    def window(self) -> Tensor:
        """Periodic Hann window of n_fft samples (scipy's get_window('hann', n_fft, fftbins=True) in float32)."""
        return torch.hann_window(self.cfg.istft_n_fft, periodic=True, dtype=torch.float64).float()

    def stft(self, source: Tensor) -> Tensor:
        """source (B,1,L) -> s_stft (B,18,L/hop+1) = [Re ; Im] of the centred, reflect-padded STFT."""
        n_fft, hop = self.cfg.istft_n_fft, self.cfg.istft_hop_len
        spec = torch.stft(source.squeeze(1), n_fft, hop, n_fft, window=self.window(), return_complex=True)
        return torch.cat([spec.real, spec.imag], dim=1)

    def conv_decode(self, mel: Tensor, s_stft: Tensor) -> Tensor:
        """mel (B,80,T) and s_stft (B,18,120T+1) -> conv_post output (B,18,120T+1): log-magnitude ; phase."""
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

    def istft(self, x: Tensor) -> Tensor:
        """conv_post output (B,18,F) -> waveform (B,hop·(F-1)): exp/clip magnitude, sin phase, iSTFT, clamp."""
        n_fft, hop = self.cfg.istft_n_fft, self.cfg.istft_hop_len
        magnitude = torch.clip(torch.exp(x[:, : self.num_bins]), max=_MAGNITUDE_MAX)
        phase = torch.sin(x[:, self.num_bins :])
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        wav = torch.istft(spec, n_fft, hop, n_fft, window=self.window())
        return torch.clamp(wav, -self.cfg.audio_limit, self.cfg.audio_limit)

    def decode(self, mel: Tensor, source: Tensor) -> Tensor:
        """mel (B,80,T) and source (B,1,480T) -> waveform (B,480T) float32 in [-audio_limit, audio_limit]."""
        return self.istft(self.conv_decode(mel, self.stft(source)))
