"""cosyvoice-lite: the torch-free serving package; importing it turns ONNX Runtime's telemetry off unless asked for."""

import os

# ONNX Runtime 1.31's Linux wheels start their 1DS telemetry when onnxruntime is imported: a device id written to
# ~/.cache/Microsoft/DeveloperTools/.onnxruntime and a ProcessInfo event sent out, plus a warning at every start where
# that directory is not writable (the image). ORT_DISABLE_TELEMETRY=1 before the import is its full opt-out; this
# package is imported before service.engine imports onnxruntime. ORT_DISABLE_TELEMETRY=0 in the environment turns it on.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
