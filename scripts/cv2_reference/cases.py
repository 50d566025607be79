"""The fixture cases: prompts, texts, seeds and forced-token counts for every recorded official call."""

from __future__ import annotations

from dataclasses import dataclass

# Prompt recordings (espeak-ng speech; the same files as tests/reference/tiny/prompts) and their transcripts.
PROMPTS = {
    "zh_16k": "希望你以后能够做的比我还好呦。",
    "en_24k": "The weather is lovely today, let us take a walk in the park.",
    "en_48k_stereo": "Please call me back when you get this message.",
}


@dataclass(frozen=True)
class Case:
    """One official `inference_*` call: one sentence, teacher-forced with `n_tokens` random speech tokens."""

    mode: str  # zero_shot | cross_lingual | instruct2
    prompt: str
    tts_text: str
    n_tokens: int
    seed: int  # torch.manual_seed before the call; forced tokens from numpy RandomState(seed)
    instruct_text: str = ""


MODE_CASES = [
    Case("zero_shot", "zh_16k", "收到好友从远方寄来的生日礼物，那份意外的惊喜让我心中充满了快乐。", 44, 1000),
    Case("zero_shot", "en_24k", "Hello world! This is a test of the voice cloning system.", 32, 1001),
    Case(
        "cross_lingual",
        "en_48k_stereo",
        "在他讲述那个荒诞故事的过程中，他突然[laughter]停下来，因为他自己也被逗笑了[laughter]。",
        48,
        2000,
    ),
    Case("cross_lingual", "zh_16k", "<|en|>The meeting starts at nine, please do not be late.", 30, 2001),
    Case("instruct2", "zh_16k", "今天天气很好，我们一起去公园散步吧。", 36, 3000, "用四川话说这句话<|endofprompt|>"),
    Case(
        "instruct2",
        "en_24k",
        "On Jan. 5, 2024 the ticket cost $12.50.",
        34,
        3001,
        "Speak slowly, in a cheerful tone.<|endofprompt|>",
    ),
]


@dataclass(frozen=True)
class StreamCase:
    """One official stream=True call; the forced token count is chosen from the prompt's token count so that the
    schedule has the hops listed in `hops` after the first (25 + prompt pad) and then a final chunk of `tail` tokens."""

    name: str
    case: Case
    hops: tuple[int, ...]
    tail: int


STREAM_CASES = [
    StreamCase(
        "zs",
        Case("zero_shot", "zh_16k", "在一个阳光明媚的早晨，小明背着书包走在上学的路上，他看到路边的花儿开得正艳。", 0, 5000),
        (50, 100, 100),
        40,
    ),
    StreamCase("cl", Case("cross_lingual", "en_24k", "[breath]今天天气很好，我们一起去公园散步吧。", 0, 5001), (50,), 20),
    StreamCase(
        "i2",
        Case("instruct2", "en_48k_stereo", "收到好友从远方寄来的生日礼物。", 0, 5002, "用开心的语气说<|endofprompt|>"),
        (),
        30,
    ),
]

# Texts through the official text_normalize + tokenizer (no model call).
TOKENIZER_TEXTS = {
    "zh_numbers_dates_english": "2024年3月15日，我们在北京发布了CosyVoice 2.0版本，售价99.5元，支持100种语言。",
    "en_numbers": "On Jan. 5, 2024 the ticket cost $12.50, and 3 kg of apples cost 7 dollars.",
    "mixed_zh_en": "今天天气很好，我们一起去 park 散步吧，然后看一场 movie。",
    "fine_grained_tags": "在他讲述那个荒诞故事的过程中，他突然[laughter]停下来，因为他自己也被逗笑了[laughter]。",
    "strong_and_breath": "[breath]这是<strong>非常</strong>重要的事情。",
    "instruct_raw": "用四川话说这句话<|endofprompt|>",
    "language_tag_skips_frontend": "<|en|>The meeting starts at nine, please do not be late.",
    "japanese": "こんにちは、今日はいい天気ですね。東京に行きたいです。",
    "korean": "안녕하세요, 만나서 반갑습니다.",
    "cantonese": "我哋今日去咗公園玩，好開心呀！你食咗飯未呀？",
    "nfd_accents": "Cafe\u0301 de\u0301ja\u0300 vu, the re\u0301sume\u0301 is na\u0131\u0308ve.",
    "emoji_and_symbols": "Great job! 🎉👍 100% done — see you @ 9:30?",
    "very_short": "好",
    "long_en_split": (
        "The quick brown fox jumps over the lazy dog near the riverbank every single morning. "
        "Meanwhile, the farmer counts his sheep and wonders whether the weather will hold until the harvest is finished. "
        "Children laugh in the distance while the old church bell rings twelve times, marking the middle of the day. "
        "Nobody notices the small bird that has built a nest in the chimney of the abandoned house on the hill. "
        "When evening comes, the lights of the village appear one by one, and the river keeps flowing towards the sea."
    ),
}
