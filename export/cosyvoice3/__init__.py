"""Fun-CosyVoice3-0.5B checkpoints to bundles: config, torch modules, graphs with explicit caches, bundle writer."""
