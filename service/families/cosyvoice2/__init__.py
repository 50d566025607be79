"""CosyVoice2-0.5B: its bundle contract (contract.py), the cached chunk-causal engine over the shared Qwen2 LLM, flow and
vocoder layers, voices and verification. `family.py` is its registry entry."""
