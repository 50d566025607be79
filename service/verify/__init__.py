"""Verification against the reference fixtures: `checks` measures, the stage modules replay, `run` runs them all."""
