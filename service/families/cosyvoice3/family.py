"""Fun-CosyVoice3-0.5B's entry in the family registry."""

from service.families.cosyvoice3.contract import FAMILY as NAME
from service.families.cosyvoice3.contract import LAYOUT
from service.families.cosyvoice3.model import check_options, load_engine, load_model
from service.families.cosyvoice3.verify import run_verification3
from service.families.model import Family

FAMILY = Family(NAME, LAYOUT, verify=run_verification3, load=load_model, check=check_options, engine=load_engine)
