"""Verification against the official implementation: what a comparison measures (checks); each family replays its
fixtures (service/families/<name>/verify) and the registry picks the family's."""
