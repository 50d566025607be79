"""Fun-CosyVoice3 graphs: wrappers, export and ONNX Runtime vs torch checks."""
