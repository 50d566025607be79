"""Layers several model families share (TEI's layers/ beside models/): the Qwen2 LLM, the BPE tokenizer, prompt analysis,
chunk-causal flow caches, HiFT vocoders, signal and feature helpers. A family imports them and the kit; they import
the kit, never a family."""
