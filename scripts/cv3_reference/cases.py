"""The CosyVoice3 fixture cases: prompts, texts (with the system prefix and <|endofprompt|>), seeds, forced tokens."""

from __future__ import annotations

from dataclasses import dataclass

from cv2_reference.cases import PROMPTS

SYSTEM = "You are a helpful assistant."
END_OF_PROMPT = "<|endofprompt|>"
# CosyVoice3Model.silent_tokens (cosyvoice/cli/model.py:423); llm_job passes at most 5 in a row (model.py:102-128).
SILENT_TOKENS = (1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323)
MAX_SILENT_RUN = 5
PRESET_SICHUAN = "You are a helpful assistant. 请用四川话表达。<|endofprompt|>"  # instruct_list[14] (common.py:42)


def zero_shot_prompt_text(prompt: str) -> str:
    """How the official example writes a CosyVoice3 zero-shot prompt text (example.py:76): system, marker, transcript."""
    return f"{SYSTEM}{END_OF_PROMPT}{PROMPTS[prompt]}"


@dataclass(frozen=True)
class Case:
    """One official `inference_*` call: one sentence, teacher-forced with `n_tokens` random speech tokens.

    `silent_run` = (start, length) overwrites that many forced tokens with the official silent tokens in turn, so the
    LLM emits a run the official filter shortens before the flow.
    """

    mode: str  # zero_shot | cross_lingual | instruct2
    prompt: str
    tts_text: str
    n_tokens: int
    seed: int  # torch.manual_seed before the call; forced tokens from numpy RandomState(seed)
    instruct_text: str = ""
    silent_run: tuple[int, int] = (0, 0)

    @property
    def prompt_text(self) -> str | None:
        return zero_shot_prompt_text(self.prompt) if self.mode == "zero_shot" else None


MODE_CASES = [
    Case("zero_shot", "zh_16k", "收到好友从远方寄来的生日礼物，那份意外的惊喜让我心中充满了快乐。", 44, 1000),
    Case("zero_shot", "en_24k", "Hello world! This is a test of the voice cloning system.", 32, 1001, silent_run=(10, 8)),
    Case(
        "cross_lingual",
        "en_48k_stereo",
        f"{SYSTEM}{END_OF_PROMPT}在他讲述那个荒诞故事的过程中，他突然[laughter]停下来，因为他自己也被逗笑了[laughter]。",
        48,
        2000,
    ),
    Case("cross_lingual", "zh_16k", f"{SYSTEM}{END_OF_PROMPT}On Jan. 5, 2024 the meeting starts at 9:30.", 30, 2001),
    Case("instruct2", "zh_16k", "今天天气很好，我们一起去公园散步吧。", 36, 3000, PRESET_SICHUAN),
    Case(
        "instruct2",
        "en_24k",
        "On Jan. 5, 2024 the ticket cost $12.50.",
        34,
        3001,
        f"{SYSTEM} Speak slowly, in a cheerful tone.{END_OF_PROMPT}",
    ),
]


@dataclass(frozen=True)
class StreamCase:
    """One official stream=True call; the forced token count gives the schedule a first chunk (25 + prompt pad), the
    hops in `hops`, then a final chunk of `tail` tokens."""

    name: str
    case: Case
    hops: tuple[int, ...]
    tail: int


STREAM_CASES = [
    StreamCase(
        "zs", Case("zero_shot", "en_48k_stereo", "在一个阳光明媚的早晨，小明背着书包走在上学的路上。", 0, 5000), (50,), 24
    ),
    StreamCase(
        "cl",
        Case("cross_lingual", "en_24k", f"{SYSTEM}{END_OF_PROMPT}[breath]今天天气很好，我们一起去公园散步吧。", 0, 5001),
        (),
        20,
    ),
    StreamCase(
        "i2",
        Case("instruct2", "zh_16k", "收到好友从远方寄来的生日礼物。", 0, 5002, f"{SYSTEM} 用开心的语气说。{END_OF_PROMPT}"),
        (),
        30,
    ),
]

# Texts through the official text_normalize + CosyVoice3 tokenizer (no model call).
TOKENIZER_TEXTS = {
    "system_prefix_only": f"{SYSTEM}{END_OF_PROMPT}",
    "zero_shot_prompt_text": zero_shot_prompt_text("zh_16k"),
    "cross_lingual_text": f"{SYSTEM}{END_OF_PROMPT}[breath]因为他们那一辈人[breath]在乡里面住的要习惯一点。",
    "instruct_preset": PRESET_SICHUAN,
    "instruct_free_text": f"{SYSTEM} Speak slowly, in a cheerful tone.{END_OF_PROMPT}",
    "end_of_system": f"{SYSTEM}<|endofsystem|>请用广东话表达。{END_OF_PROMPT}",
    "pinyin_hotfix": "高管也通过电话、短信、微信等方式对报道[j][ǐ]予好评。",
    "cmu_phones": "Say [HH][AH0][L][OW1] to [W][ER1][L][D] please.",
    "markup_skips_frontend": f"{SYSTEM}{END_OF_PROMPT}On Jan. 5, 2024 it cost $12.50. " * 12,
    "zh_numbers_dates": "2024年3月15日，我们发布了CosyVoice 3.0版本，售价99.5元。",
    "en_numbers": "On Jan. 5, 2024 the ticket cost $12.50, and 3 kg of apples cost 7 dollars.",
    "mixed_zh_en": "今天天气很好，我们一起去 park 散步吧，然后看一场 movie。",
    "fine_grained_tags": "[breath]这是<strong>非常</strong>重要的事情[laughter]。",
    "japanese_katakana": "レキシ テキ セカイ ニ オイ テ ワ、カコ ワ タンニ スギサッ タ モノ デ ワ ナイ。",
    "long_en_split": (
        "The quick brown fox jumps over the lazy dog near the riverbank every single morning. "
        "Meanwhile, the farmer counts his sheep and wonders whether the weather will hold until the harvest is finished. "
        "Children laugh in the distance while the old church bell rings twelve times, marking the middle of the day. "
        "Nobody notices the small bird that has built a nest in the chimney of the abandoned house on the hill. "
        "When evening comes, the lights of the village appear one by one, and the river keeps flowing towards the sea."
    ),
}
