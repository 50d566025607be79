"""CosyVoice-300M (-SFT, -Instruct): its bundle contract (contract.py), LLM, flow, HiFT streaming, schedule, voices and
verification. `family.py` is its registry entry."""
