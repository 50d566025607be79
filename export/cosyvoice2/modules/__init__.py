"""Torch modules that load the official CosyVoice2 state dicts (llm.pt, flow.pt) with their key names."""
