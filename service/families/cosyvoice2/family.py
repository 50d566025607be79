"""CosyVoice2-0.5B's entry in the family registry."""

from service.families.cosyvoice2.contract import FAMILY as NAME
from service.families.cosyvoice2.contract import LAYOUT
from service.families.cosyvoice2.model import check_options, load_engine, load_model
from service.families.cosyvoice2.verify import run_verification2
from service.families.model import Family

FAMILY = Family(NAME, LAYOUT, verify=run_verification2, load=load_model, check=check_options, engine=load_engine)
