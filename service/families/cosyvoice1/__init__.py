"""CosyVoice-300M (-SFT, -Instruct): the model family a manifest without `family` names."""

from service.bundle import FAMILY_V1
from service.families.cosyvoice1.model import check_options, load_model
from service.families.cosyvoice1.verify.run import run_verification
from service.families.model import Family

FAMILY = Family(FAMILY_V1, verify=run_verification, load=load_model, check=check_options)
