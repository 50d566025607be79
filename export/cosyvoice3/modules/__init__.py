"""Fun-CosyVoice3 torch modules with the official key names (LLM, DiT flow, causal HiFT)."""
