"""The gRPC transport: the official CosyVoice proto, its generated modules and the server on the shared runtime."""
