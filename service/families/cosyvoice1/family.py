"""CosyVoice-300M's entry in the family registry."""

from service.families.cosyvoice1.contract import FAMILY as NAME
from service.families.cosyvoice1.contract import LAYOUT
from service.families.cosyvoice1.model import check_options, load_model, load_synthesizer
from service.families.cosyvoice1.verify.run import run_verification
from service.families.model import Family

FAMILY = Family(NAME, LAYOUT, verify=run_verification, load=load_model, check=check_options, engine=load_synthesizer)
