"""What the chunk-causal flows of the Qwen2-based families share on the torch side: the chunk mask of new positions
over cached ones, the look-ahead layer that turns speech tokens into the flow's input, and the cached attention core
whose ONNX form the native twin rewrites (export/fuse_ops.py fuse_attention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FULL_ATTENTION = 1 << 30  # a chunk size no sequence reaches: one chunk, i.e. the non-streaming masks
CONV_TAIL = 2  # positions of left context the look-ahead layer's causal conv2 keeps (and CosyVoice2's other convs)


def chunk_allowed(n_past: int, n_new: int, chunk: Tensor) -> Tensor:
    """(T, C+T) bool: new position C+i sees every cached position and new position C+j iff their chunks allow it.

    A key is visible when its chunk index is not after the query's (official subsequent_chunk_mask with all left
    chunks), counted from the start of the sequence; `chunk` (1,) int64 frames per chunk (a huge value = full attention).
    """
    pos = n_past + torch.arange(n_new)
    new = torch.div(pos.view(1, -1), chunk, rounding_mode="floor") <= torch.div(pos.view(-1, 1), chunk, rounding_mode="floor")
    return torch.cat((torch.ones(n_new, n_past, dtype=torch.bool), new), dim=1)


def attend_cached(q: Tensor, k: Tensor, v: Tensor, past_k: Tensor, past_v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """softmax(q·[past_k; k]ᵀ·scale + bias)·[past_v; v] for heads-first q, k, v (B,H,T,DK) after past_k, past_v
    (B,H,C,DK); bias (T,C+T) additive. Returns (B,H,T,DK). The two score products and the two value products stay apart
    (no concatenated cache), the form fuse_attention matches."""
    scores = torch.cat((torch.matmul(q, past_k.transpose(-1, -2)), torch.matmul(q, k.transpose(-1, -2))), dim=-1)
    attn = torch.softmax(scores * scale + bias, dim=-1)
    n_past = past_k.shape[2]
    return torch.matmul(attn[..., :n_past], past_v) + torch.matmul(attn[..., n_past:], v)


class PreLookaheadLayer(nn.Module):
    """conv1 (kernel look_ahead+1) over the position and the next look_ahead ones, LeakyReLU, causal conv2 (k3) back to
    the input width, residual (official PreLookaheadLayer(in_channels, channels))."""

    def __init__(self, in_channels: int, channels: int, look_ahead: int) -> None:
        super().__init__()
        self.look_ahead = look_ahead
        self.conv1 = nn.Conv1d(in_channels, channels, look_ahead + 1)
        self.conv2 = nn.Conv1d(channels, in_channels, CONV_TAIL + 1)

    def chunk_step(self, x: Tensor, context: Tensor, cache: Tensor) -> tuple[Tensor, Tensor]:
        """x (B,T,D) and its look-ahead context (B,K,D), K <= look_ahead (zeros stand in for the missing ones);
        cache (B,C,2) holds conv1's outputs of the two positions before x. Returns (out (B,T,D), new cache)."""
        seq = torch.cat((x, context), dim=1).transpose(1, 2)
        seq = F.pad(seq, (0, self.look_ahead - context.shape[1]))
        hidden = torch.cat((cache, F.leaky_relu(self.conv1(seq))), dim=2)
        return self.conv2(hidden).transpose(1, 2) + x, hidden[:, :, -CONV_TAIL:]
