"""CosyVoice2 exporter: our torch modules for the official v2 checkpoint, its ONNX graphs, and the bundle writer."""
