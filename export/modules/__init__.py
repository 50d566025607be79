"""Torch modules that load the official CosyVoice state dicts with their original key names."""
