"""CosyVoice2-0.5B engine numerics: Qwen2 LLM on the shared batching design, chunk-causal flow with caches, HiFT.

Registered for `python -m service verify`; not served yet (its serving frontend is still to come).
"""

from service.bundle import FAMILY_V2
from service.families.cosyvoice2.verify import run_verification2
from service.families.model import Family

FAMILY = Family(FAMILY_V2, verify=run_verification2)
