"""CosyVoice2-0.5B engine numerics: Qwen2 LLM on the shared batching design, chunk-causal flow with caches, HiFT."""
