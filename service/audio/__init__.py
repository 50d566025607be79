"""Audio bytes: float audio encoded into formats (with resampling), prompt recordings decoded, timelines counted."""
