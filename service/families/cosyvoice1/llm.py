"""CosyVoice-300M's LLM: the text encoder graph, the decoder's relative positions, and the step graph on the kit's runner."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from service.bundle import ModelConstants
from service.bundle.external import op_types
from service.engine.llm import LLMRunner, inputs_dtype
from service.engine.types import LLMPrompt, as_llm_prompt
from service.errors import InvalidInputError
from service.families.cosyvoice1.contract import RELPOS_LAYER_OP
from service.families.cosyvoice1.positions import PositionTable

LLM_GRAPHS: tuple[str, ...] = ("llm_encoder", "llm_embed", "llm_pos", "llm_step")
PROJECT_ROWS = 128  # relative-position rows `llm_pos` projects per call
# Graphs only needed to (re)build a table: opened for that call and released, so their weights do not
# stay resident (llm_pos holds NL x D x D fp32 weights, 58 MB full-size, used once per table size).
TRANSIENT_GRAPHS: frozenset[str] = frozenset({"llm_pos"})


def reads_rows_in_use(step_graph: Path) -> bool:
    """Whether the step graph at `step_graph` runs its layers as RELPOS_LAYER_OP (a native twin), which reads only the
    position rows of the distances in use: it is fed the whole table then, not windows (PositionTable)."""
    try:
        return RELPOS_LAYER_OP in op_types(step_graph)
    except (OSError, ValueError):  # a file ONNX Runtime itself will refuse, with its reason
        return False


def position_dtype(step_session: Any) -> type[np.floating]:
    """The element type of the step graph's `pos_i` inputs: float16 (a native twin since its positions were halved,
    export/cosyvoice1/relpos_twin.py) or float32."""
    return inputs_dtype(step_session, ("pos_",))


def position_table(pos_session: Any, constants: ModelConstants, rows: int = 512, *, windowed: bool = True) -> PositionTable:
    """The projected position table of the decoder, built now with the `llm_pos` graph (and grown with it);
    `windowed` for a step graph that reads every row it is given (PositionTable)."""

    def project(pe: np.ndarray) -> np.ndarray:
        """Rows a piece at a time (each row's projection is its own): a long table (a long recording's prompt) costs
        the graph's arena one piece's intermediates, not the whole table's (119 MB at 1,024 rows, full size)."""
        pieces = [pos_session.run(["pos"], {"pe": pe[i : i + PROJECT_ROWS]})[0] for i in range(0, len(pe), PROJECT_ROWS)]
        return np.concatenate(pieces, axis=2, dtype=np.float32)

    return PositionTable(project, constants.llm_model_dim, rows=rows, windowed=windowed)


class CosyVoice1LLM(LLMRunner):
    """The v1 LLM: prefill [sos, speaker, encoded prompt text ++ text, task, prompt speech tokens]; every step reads the
    projected relative positions of its length (`positions`, built with `llm_pos` unless given)."""

    GRAPHS = LLM_GRAPHS

    def __init__(
        self,
        sessions: Mapping[str, Any],
        constants: ModelConstants,
        *,
        position_rows: int = 512,
        positions: PositionTable | None = None,
    ) -> None:
        self._position_rows = position_rows
        self._given_positions = positions
        super().__init__(sessions, constants)

    def _bind(self, sessions: Mapping[str, Any]) -> None:
        """The v1 text encoder and the decoder's relative-position table."""
        self._encoder = sessions["llm_encoder"]
        given = self._given_positions
        self.positions = given or position_table(sessions["llm_pos"], self.constants, self._position_rows)
        self.positions.hold_as(position_dtype(sessions["llm_step"]))

    def encode(self, text_ids: Sequence[int], prompt: LLMPrompt | np.ndarray) -> np.ndarray:
        """LM input sequence (L, DI) float32, official order: [sos, speaker, encoded prompt text ++ text, task,
        prompt speech tokens]; the speaker row is left out when the prompt has no embedding (instruct).
        `prompt` may be a built-in speaker's bare x-vector."""
        prompt = as_llm_prompt(prompt)
        ids = np.asarray([*prompt.prompt_text_ids, *text_ids], dtype=np.int64).reshape(1, -1)
        if len(text_ids) == 0:
            raise InvalidInputError("text_ids is empty")
        dim = self.constants.spk_embed_dim
        emb = np.zeros((1, dim), dtype=np.float32) if prompt.embedding is None else prompt.embedding.reshape(1, -1)
        if emb.shape[1] != dim:
            raise InvalidInputError(f"speaker embedding must have {dim} values, got {emb.shape[1]}")
        lm_input = self._encoder.run(["lm_input"], {"text_ids": ids, "embedding": emb})[0][0]
        if prompt.embedding is None:  # the slot is a row of its own: drop it (the text encoder never sees it)
            lm_input = np.delete(lm_input, 1, axis=0)
        if prompt.speech_tokens:
            tokens = np.asarray(prompt.speech_tokens, dtype=np.int64)[None]
            (speech,) = self._embed.run(["x"], {"token": tokens})
            lm_input = np.concatenate([lm_input, speech[0]], axis=0)
        return np.ascontiguousarray(lm_input, dtype=np.float32)

    def _run_step(self, x: np.ndarray, past: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """llm_step over new inputs x (B,T,DI) after the cached past -> logp (B,V), new K/V (NL,B,H,T,DK)."""
        feeds = dict(past)
        feeds["x"] = x
        feeds.update(self.positions.feeds(int(past["past_len"].max()) + x.shape[1]))
        logp, new_k, new_v = self._step.run(["logp", "new_k", "new_v"], feeds)
        return logp, new_k, new_v
