"""Fun-CosyVoice3-0.5B: its bundle contract (contract.py), the cached chunk-causal engine over the shared Qwen2 LLM, a
DiT flow with bounded caches and a causal HiFT, voices and verification. `family.py` is its registry entry."""
