"""ONNX graph wrappers and exporters, one module per model part."""
