"""CosyVoice-300M against the official implementation's fixtures: model stages, prompt analysis, cloning modes."""
