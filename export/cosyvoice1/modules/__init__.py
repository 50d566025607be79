"""CosyVoice-300M's torch modules (LLM)."""
