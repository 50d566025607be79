"""CosyVoice-300M's exporter graphs (LLM, flow)."""
