"""What every CosyVoice2 graph module shares: names from its bundle contract (the rest is export/graphs/common.py)."""

from __future__ import annotations

from export.graphs import common
from export.graphs.common import max_error, run, session
from service.families.cosyvoice2.contract import GRAPH_IO, CosyVoice2Constants

__all__ = ["graph_names", "max_error", "run", "session"]


def graph_names(graph: str, num_layers: int, extra: CosyVoice2Constants) -> tuple[list[str], list[str]]:
    """Expanded input and output names of a CosyVoice2 graph."""
    return common.graph_names(GRAPH_IO, graph, num_layers, extra.graph_counts())
