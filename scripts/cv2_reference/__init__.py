"""Reference fixtures from the official CosyVoice2 code: a random checkpoint builder and the recording harness."""
