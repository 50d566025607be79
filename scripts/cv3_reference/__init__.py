"""Reference fixtures from the official Fun-CosyVoice3 code: a random checkpoint builder and the recording harness."""
