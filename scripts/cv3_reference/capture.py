"""Hooks on one official CosyVoice3 instance: what each stage received and returned during one `inference_*` call.

The LLM and model hooks are CosyVoice2's (`cv2_reference.capture`: `CosyVoice3LM` inherits `Qwen2LM`'s decoding loop,
`CosyVoice3Model.tts` is `CosyVoice2Model.tts`); the flow (pre-look-ahead layer + DiT) and the causal HiFT differ.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
from cv2_reference.capture import Capture, _llm_hooks, _model_hooks
from cv2_reference.recorder import ForcedTokens, observed_rng, to_numpy, wrapped

SPEECH_TOKENS = 6561  # CosyVoice3LM.speech_token_size: sos 6561, eos 6562, task 6563, fill 6564 (llm.py:681-684)
EOS = SPEECH_TOKENS + 1
DIT_PARTS = ("time_embed", "input_embed", "norm_out")


def raw(value: Any) -> np.ndarray:
    """A detached copy that keeps float64 (the causal f0 predictor runs in float64)."""
    return np.array(value.detach().cpu().numpy(), copy=True)


def _estimator_hooks(stack: ExitStack, estimator: Any, sink: dict[str, Any]) -> None:
    """Keep the DiT's time embedding, input embedding, every block's output and the final norm of one call."""

    def keep(name: str) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:  # returns None: the output is not replaced
            sink.setdefault(name, to_numpy(output))

        return hook

    for name in DIT_PARTS:
        handle = getattr(estimator, name).register_forward_hook(keep(name))
        stack.callback(handle.remove)
    for i, block in enumerate(estimator.transformer_blocks):
        handle = block.register_forward_hook(keep(f"block{i}"))
        stack.callback(handle.remove)


def _flow_hooks(stack: ExitStack, cv: Any, cap: Capture, dit_internals: bool) -> None:
    flow = cv.model.flow
    current: dict[str, Any] = {}

    def inference(original: Any, **kwargs: Any) -> Any:
        current.clear()
        current.update({k: to_numpy(kwargs[k]) for k in ("token", "prompt_token", "prompt_feat", "embedding")})
        current.update(streaming=bool(kwargs["streaming"]), finalize=bool(kwargs["finalize"]), est_steps=[], dit={})
        feat, cache = original(**kwargs)
        current["feat"] = to_numpy(feat)
        cap.flow_calls.append(dict(current))
        return feat, cache

    def solve_euler(original: Any, x: Any, t_span: Any, mu: Any, mask: Any, spks: Any, cond: Any, streaming: bool = False) -> Any:
        current.update(z=to_numpy(x), t_span=to_numpy(t_span), mu=to_numpy(mu), mask=to_numpy(mask))
        current.update(spks=to_numpy(spks), cond=to_numpy(cond), solver_streaming=bool(streaming))
        out = original(x, t_span, mu, mask, spks, cond, streaming)
        current["solver_out"] = to_numpy(out)
        return out

    def forward_estimator(
        original: Any, x: Any, mask: Any, mu: Any, t: Any, spks: Any, cond: Any, streaming: bool = False
    ) -> Any:
        step = {"x": to_numpy(x), "mask": to_numpy(mask), "mu": to_numpy(mu), "t": to_numpy(t)}
        step.update(spks=to_numpy(spks), cond=to_numpy(cond), streaming=bool(streaming))
        with ExitStack() as hooks:
            if dit_internals and not current["est_steps"]:
                _estimator_hooks(hooks, flow.decoder.estimator, current["dit"])
            out = original(x, mask, mu, t, spks, cond, streaming)
        step["out"] = to_numpy(out)
        current["est_steps"].append(step)
        return out

    def keep_lookahead(_module: Any, _inputs: Any, output: Any) -> None:
        current["lookahead_h"] = to_numpy(output)

    stack.enter_context(wrapped(flow, "inference", inference))
    stack.enter_context(wrapped(flow.decoder, "solve_euler", solve_euler))
    stack.enter_context(wrapped(flow.decoder, "forward_estimator", forward_estimator))
    handle = flow.pre_lookahead_layer.register_forward_hook(keep_lookahead)
    stack.callback(handle.remove)


def _hift_hooks(stack: ExitStack, cv: Any, cap: Capture) -> None:
    hift = cv.model.hift
    f0: list[np.ndarray] = []

    def inference(original: Any, speech_feat: Any, finalize: bool = True) -> Any:
        draws: list[tuple[str, np.ndarray]] = []
        f0.clear()
        with observed_rng(draws):
            speech, source = original(speech_feat=speech_feat, finalize=finalize)
        assert not draws, "the causal HiFT drew random numbers: it should use its fixed buffers only"
        call = {"mel": to_numpy(speech_feat), "finalize": bool(finalize), "f0": f0[0], "source": to_numpy(source)}
        call["speech"] = to_numpy(speech)
        cap.hift_calls.append(call)
        return speech, source

    handle = hift.f0_predictor.register_forward_hook(lambda _m, _i, output: f0.append(raw(output)))
    stack.callback(handle.remove)
    stack.enter_context(wrapped(hift, "inference", inference))


@contextmanager
def capturing(cv: Any, forced_tokens: list[int], dit_internals: bool = False) -> Iterator[Capture]:
    """Hooks installed on `cv` for one official `inference_*` call; the LLM is teacher-forced, then gives EOS (6562)."""
    cap = Capture(forced=ForcedTokens(forced_tokens, EOS))
    with ExitStack() as stack:
        _llm_hooks(stack, cv, cap)
        _flow_hooks(stack, cv, cap, dit_internals)
        _hift_hooks(stack, cv, cap)
        _model_hooks(stack, cv, cap)
        yield cap


def run(cv: Any, call: Any, forced_tokens: list[int], seed: int, dit_internals: bool = False) -> Capture:
    """Run `call()` (an official inference_* generator) with hooks, torch seeded, collecting every yielded chunk."""
    import torch

    with capturing(cv, forced_tokens, dit_internals) as cap:
        torch.manual_seed(seed)
        for output in call():
            cap.yielded.append(to_numpy(output["tts_speech"]))
    return cap


def hift_direct(hift: Any, feat: np.ndarray, contour: np.ndarray | None, finalize: bool) -> dict[str, np.ndarray]:
    """One `hift.inference` call on `feat` [1, 80, frames]; `contour` (Hz per frame) replaces the predicted f0."""
    import torch

    f0: list[np.ndarray] = []

    def predicted(_module: Any, _inputs: Any, output: Any) -> Any:
        if contour is not None:
            output = torch.from_numpy(contour[: output.shape[1]].astype(np.float64))[None]
        f0.append(raw(output))
        return output

    handle = hift.f0_predictor.register_forward_hook(predicted)
    draws: list[tuple[str, np.ndarray]] = []
    try:
        with torch.inference_mode(), observed_rng(draws):
            speech, source = hift.inference(speech_feat=torch.from_numpy(feat), finalize=finalize)
    finally:
        handle.remove()
    assert not draws
    return {"f0": f0[0], "source": to_numpy(source), "speech": to_numpy(speech)}
