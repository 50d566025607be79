"""CosyVoice2-0.5B: Qwen2 LLM on the shared batching design, chunk-causal flow with caches, HiFT at 24 kHz."""

from service.bundle import FAMILY_V2
from service.families.cosyvoice2.model import check_options, load_model
from service.families.cosyvoice2.verify import run_verification2
from service.families.model import Family

FAMILY = Family(FAMILY_V2, verify=run_verification2, load=load_model, check=check_options)
