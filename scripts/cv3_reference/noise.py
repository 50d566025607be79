"""The fixed noise tensors of the official CosyVoice3 flow and causal HiFT: where they live, their digests, the used prefix.

None of them is a registered buffer, so no checkpoint file carries them: the official code draws them from torch's
global generator while the yaml is loaded (`CausalConditionalCFM.__init__`, flow_matching.py:196-200, after
`set_all_random_seed(0)`; `SineGen2.__init__`, hifigan/generator.py:223-226, and `SourceModuleHnNSF.__init__`,
:355-356, with whatever generator state the modules built before them left). A runtime must ship the values.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

FLOW_NOISE_RECIPE = (
    "set_all_random_seed(0); torch.randn([1, 80, 50 * 300]) in CausalConditionalCFM.__init__ (flow_matching.py:199-200)"
)
HIFT_NOISE_RECIPE = (
    "torch.rand(1, 9) with [:, 0] = 0 (rand_ini), then torch.rand(1, 300 * 24000, 9) (sine_waves) in SineGen2.__init__ "
    "(generator.py:224-226), then torch.rand(1, 300 * 24000, 1) (uv) in SourceModuleHnNSF.__init__ (:356), drawn from "
    "the generator state that the yaml's seeds and every module built before them left (so it depends on the sizes)"
)


def tensors(flow: Any, hift: Any) -> dict[str, Any]:
    """name -> the official tensor object (flow rand_noise, SineGen2 rand_ini and sine_waves, SourceModuleHnNSF uv)."""
    source = hift.m_source
    return {
        "flow_rand_noise": flow.decoder.rand_noise,
        "hift_rand_ini": source.l_sin_gen.rand_ini,
        "hift_sine_waves": source.l_sin_gen.sine_waves,
        "hift_uv": source.uv,
    }


def sha256_float32(value: Any) -> str:
    return hashlib.sha256(np.ascontiguousarray(value.numpy(), dtype="<f4").tobytes()).hexdigest()


def buffer_digests(flow: Any, hift: Any) -> dict[str, Any]:
    """Shape, dtype and sha256 (float32 little-endian, C order) of each fixed noise tensor."""
    return {
        name: {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."), "sha256": sha256_float32(value)}
        for name, value in tensors(flow, hift).items()
    }
