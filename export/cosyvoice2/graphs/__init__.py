"""CosyVoice2 graph wrappers with explicit caches, their export and onnxruntime parity checks."""
