"""HTTP routes: synthesis (/tts, /inference_sft), the OpenAI-compatible /v1, and operations (/healthz, /readyz, /metrics, /)."""
