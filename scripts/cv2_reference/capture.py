"""Hooks on one official CosyVoice2 instance: what each stage received and returned during one `inference_*` call."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cv2_reference.recorder import ForcedTokens, observed_rng, to_numpy, wrapped

SPEECH_TOKENS = 6561  # Qwen2LM.speech_token_size; EOS = 6561, stop tokens 6561..6563


@dataclass
class Capture:
    """Everything recorded during one official call (lists are in call order)."""

    forced: ForcedTokens
    model_input: dict[str, np.ndarray] = field(default_factory=dict)
    normalized: list[tuple[str, bool, Any]] = field(default_factory=list)
    llm_steps: list[dict[str, Any]] = field(default_factory=list)
    flow_calls: list[dict[str, Any]] = field(default_factory=list)
    hift_calls: list[dict[str, Any]] = field(default_factory=list)
    token2wav_calls: list[dict[str, Any]] = field(default_factory=list)
    yielded: list[np.ndarray] = field(default_factory=list)


def _llm_hooks(stack: ExitStack, cv: Any, cap: Capture) -> None:
    llm = cv.model.llm

    def forward_one_step(original: Any, xs: Any, masks: Any, cache: Any = None) -> Any:
        past = 0 if cache is None else int(cache.get_seq_length())
        hidden, new_cache = original(xs, masks, cache=cache)
        cap.llm_steps.append({"input": to_numpy(xs[0]), "past": past, "hidden": to_numpy(hidden[0, -1])})
        return hidden, new_cache

    stack.enter_context(wrapped(llm, "sampling_ids", lambda _original, *a, **k: cap.forced(*a, **k)))
    stack.enter_context(wrapped(llm.llm, "forward_one_step", forward_one_step))


def _flow_hooks(stack: ExitStack, cv: Any, cap: Capture) -> None:
    flow = cv.model.flow
    current: dict[str, Any] = {}

    def inference(original: Any, **kwargs: Any) -> Any:
        current.clear()
        current.update({k: to_numpy(kwargs[k]) for k in ("token", "prompt_token", "prompt_feat", "embedding")})
        current.update(streaming=bool(kwargs["streaming"]), finalize=bool(kwargs["finalize"]), est_steps=[])
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
        out = original(x, mask, mu, t, spks, cond, streaming)
        step["out"] = to_numpy(out)
        current["est_steps"].append(step)
        return out

    def keep(name: str) -> Any:
        return lambda _module, _inputs, output: current.__setitem__(
            name, to_numpy(output[0] if isinstance(output, tuple) else output)
        )

    stack.enter_context(wrapped(flow, "inference", inference))
    stack.enter_context(wrapped(flow.decoder, "solve_euler", solve_euler))
    stack.enter_context(wrapped(flow.decoder, "forward_estimator", forward_estimator))
    for module, name in ((flow.encoder, "encoder_h"), (flow.encoder_proj, "encoder_proj")):
        handle = module.register_forward_hook(keep(name))
        stack.callback(handle.remove)


def _hift_hooks(stack: ExitStack, cv: Any, cap: Capture) -> None:
    hift = cv.model.hift
    f0: list[np.ndarray] = []

    def inference(original: Any, speech_feat: Any, cache_source: Any = None) -> Any:
        import torch

        cache_source = torch.zeros(1, 1, 0) if cache_source is None else cache_source
        draws: list[tuple[str, np.ndarray]] = []
        f0.clear()
        with observed_rng(draws):
            speech, source = original(speech_feat=speech_feat, cache_source=cache_source)
        call = {"mel": to_numpy(speech_feat), "cache_source": to_numpy(cache_source), "f0": f0[0], "source": to_numpy(source)}
        call.update(speech=to_numpy(speech), draws=draws)
        cap.hift_calls.append(call)
        return speech, source

    handle = hift.f0_predictor.register_forward_hook(lambda _m, _i, output: f0.append(to_numpy(output)))
    stack.callback(handle.remove)
    stack.enter_context(wrapped(hift, "inference", inference))


def _model_hooks(stack: ExitStack, cv: Any, cap: Capture) -> None:
    model = cv.model

    def tts(original: Any, **kwargs: Any) -> Any:
        cap.model_input.update({k: to_numpy(v) for k, v in kwargs.items() if k not in ("stream", "speed")})
        return original(**kwargs)

    def token2wav(original: Any, **kwargs: Any) -> Any:
        cache = model.hift_cache_dict[kwargs["uuid"]]
        call: dict[str, Any] = {"token": to_numpy(kwargs["token"]), "token_offset": int(kwargs["token_offset"])}
        call.update(finalize=bool(kwargs.get("finalize", False)), stream=bool(kwargs.get("stream", False)))
        call["cache_in"] = None if cache is None else {k: to_numpy(v) for k, v in cache.items()}
        speech = original(**kwargs)
        after = model.hift_cache_dict[kwargs["uuid"]]
        call["cache_out"] = None if after is None or call["finalize"] else {k: to_numpy(v) for k, v in after.items()}
        call["speech"] = to_numpy(speech)
        cap.token2wav_calls.append(call)
        return speech

    def text_normalize(original: Any, text: Any, split: bool = True, text_frontend: bool = True) -> Any:
        out = original(text, split=split, text_frontend=text_frontend)
        cap.normalized.append((text, split, out))
        return out

    stack.enter_context(wrapped(model, "tts", tts))
    stack.enter_context(wrapped(model, "token2wav", token2wav))
    stack.enter_context(wrapped(cv.frontend, "text_normalize", text_normalize))


@contextmanager
def capturing(cv: Any, forced_tokens: list[int]) -> Iterator[Capture]:
    """Hooks installed on `cv` for the duration of one official `inference_*` call; the LLM is teacher-forced."""
    cap = Capture(forced=ForcedTokens(forced_tokens, SPEECH_TOKENS))
    with ExitStack() as stack:
        for install in (_llm_hooks, _flow_hooks, _hift_hooks, _model_hooks):
            install(stack, cv, cap)
        yield cap


def run(cv: Any, call: Any, forced_tokens: list[int], seed: int) -> Capture:
    """Run `call()` (an official inference_* generator) with hooks, torch seeded, collecting every yielded chunk."""
    import torch

    with capturing(cv, forced_tokens) as cap:
        torch.manual_seed(seed)
        for output in call():
            cap.yielded.append(to_numpy(output["tts_speech"]))
    return cap
