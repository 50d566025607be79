"""The engine kit every family runs on: ONNX Runtime sessions, the step-graph LLM with batching and sampling, the
acoustic gate, memory budget, chunk-schedule interface and the neutral request types. It names no family."""
