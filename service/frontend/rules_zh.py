"""Chinese normalization fixes applied before wetext: codes read digit by digit, ordinals, arithmetic, money, ranges
(of amounts and of decimals), negative percentages."""

from __future__ import annotations

import regex

from service.frontend.arithmetic import ZH_ARITHMETIC_RULES
from service.frontend.readings import zh_cardinal, zh_decimal, zh_digits
from service.frontend.roman import ZH_ROMAN_RULES
from service.frontend.rules import Rule, rule

_SYMBOLS_ZH = {
    ".": "点", "/": "斜杠", "-": "杠", "_": "下划线", "@": "艾特", ":": "冒号", "?": "问号",
    "=": "等于", "&": "和", "#": "井号", "%": "百分号", "+": "加", "~": "波浪号",
}  # fmt: skip
_CURRENCY_ZH = {
    "¥": "元", "￥": "元", "RMB": "元", "CNY": "元", "$": "美元", "US$": "美元", "USD": "美元",
    "HK$": "港元", "HKD": "港元", "€": "欧元", "EUR": "欧元", "£": "英镑", "GBP": "英镑",
}  # fmt: skip
_MAGNITUDE_ZH = {"k": "千", "K": "千", "M": "百万", "B": "十亿"}
_CURRENCY_PATTERN = r"HK\$|US\$|RMB|CNY|USD|HKD|EUR|GBP|[¥￥$€£]"
_AMOUNT = r"\d[\d,]*+(?:\.\d++)?+(?:万亿|亿|万|千|百万|[kKMB](?![A-Za-z]))?+"
# Words after which a run of digits is an identifier, read digit by digit.
_CODE_WORDS = (
    "电话号码|电话|手机号码|手机号|手机|号码|热线|拨打|致电|传真|座机|分机号|分机|身份证号码|身份证号|身份证|证件号|"
    "银行卡号|卡号|账号|帐号|编号|单号|订单号|工号|学号|邮编|邮政编码|验证码|密码|尾号|QQ号|QQ|微信号|车次|航班号|航班|房间号|房号"
)

_URL_TAIL = ".,;:!?)]'\""  # sentence punctuation right after an address is not part of it


def read_address_zh(address: str) -> str:
    """Spoken form of a URL or e-mail: scheme dropped, letters kept, digits one by one, symbols named."""
    address = regex.sub(r"^(?i:https?|ftp)://", "", address)
    return "".join(_SYMBOLS_ZH.get(ch, zh_digits(ch) if ch.isdigit() else ch if ch.isalpha() else "") for ch in address)


def _address(m: regex.Match[str]) -> str:
    text = m.group()
    cut = len(text.rstrip(_URL_TAIL))
    return str(read_address_zh(text[:cut]) + text[cut:])


def _code(m: regex.Match[str]) -> str:
    code = m.group("code").replace("-", "").replace(" ", "")
    return str(m.group("word") + m.group("sep") + zh_digits(code.replace("+", "加")))


def _mobile(m: regex.Match[str]) -> str:
    prefix = "加八六" if m.group("cc") else ""
    return prefix + zh_digits(m.group("num"))


def _phone(m: regex.Match[str]) -> str:
    """A phone number read digit by digit (幺 for 1), a leading + as 加; fewer than 7 digits is no phone number."""
    text = str(m.group())
    digits = "".join(ch for ch in text if ch.isdigit())
    if len(digits) < 7:
        return text
    return ("加" if text.startswith("+") else "") + zh_digits(digits)


def _version(m: regex.Match[str]) -> str:
    parts = m.group("num").split(".")
    if _is_dotted_date(parts) and not m.group("v"):
        return str(m.group())  # 2024.03.15 is a date: wetext reads it
    is_ip = not m.group("v") and len(parts) == 4 and all(int(p) <= 255 for p in parts)
    spoken = [zh_digits(p, yao=False) if is_ip or (len(p) > 1 and p[0] == "0") else zh_cardinal(p) for p in parts]
    return (m.group("v") or "") + "点".join(spoken)


def _is_dotted_date(parts: list[str]) -> bool:
    return len(parts) == 3 and len(parts[0]) == 4 and 1 <= int(parts[1]) <= 12 and 1 <= int(parts[2]) <= 31


def _decimal_range(m: regex.Match[str]) -> str:
    """`1.5-2.5` -> 1.5到2.5 (wetext reads a hyphen between decimals as 减); plain integers are left to wetext (3-5)."""
    a, b = m.group("a"), m.group("b")
    return f"{a}到{b}" if "." in a + b else str(m.group())


def _money(m: regex.Match[str]) -> str:
    """`¥1,234.50` -> 一千二百三十四点五元. An amount with a fraction is read here: wetext takes 1000.05 for a date."""
    number = m.group("num").replace(",", "")
    if "." in number:
        number = number.rstrip("0").rstrip(".")
        number = zh_decimal(number) if "." in number else number
    magnitude = m.group("mag") or ""
    magnitude = _MAGNITUDE_ZH.get(magnitude, magnitude)
    unit = _CURRENCY_ZH[m.group("cur")]
    return f"{number}{magnitude}{unit}"


ZH_RULES: tuple[Rule, ...] = (
    rule("email", r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63}){1,8}", _address),
    rule("url", r"(?<![A-Za-z0-9])(?i:(?:https?|ftp)://|www\.)[A-Za-z0-9\-._~/?#\[\]@!$&'*+,;=%:]{1,2000}+", _address),
    rule("id_card", r"(?<![0-9A-Za-z])(?P<num>\d{17}[\dXx])(?![0-9A-Za-z])", lambda m: zh_digits(m.group("num").upper())),
    rule(
        "code_after_keyword",
        rf"(?P<word>{_CODE_WORDS})(?P<sep>[是为:：\s]{{0,3}}+)"
        r"(?P<code>\+?[0-9A-Za-z](?:[- ]?+[0-9A-Za-z]){2,40}+)"
        r"(?<=\d[0-9A-Za-z]{0,8})(?![个台部次元块张条人年月日天岁])",
        _code,
    ),
    rule("mobile", r"(?<![\d+])(?P<cc>\+?86[- ]?)?(?P<num>1[3-9]\d{9})(?!\d)", _mobile),
    # Phone numbers never read as arithmetic (555-0123 is no subtraction): +1 555 012 3456, (555) 123-4567,
    # 555-123-4567, 0755-1234567, and a bare 555-0123 unless Chinese text follows it (200-1000元 is a range).
    rule(
        "phone",
        r"(?<![0-9A-Za-z+.-])(?:\+\d{1,3}+(?:[ .-]\(?+\d{1,5}+\)?+){2,6}+|\+\d{7,15}+"
        r"|(?:\(\d{3}\)[ .]?+|\d{3}[ .-])\d{3}[ .-]\d{4}|0\d{2,3}+-\d{7,8}+"
        r"|[2-9]\d{2}-\d{4}(?![\u4e00-\u9fff%])"
        r")(?![0-9A-Za-z]|[.-]\d)",
        _phone,
    ),
    rule("long_digits", r"(?<![\d.])\d{12,}+(?!\.\d)", lambda m: zh_digits(m.group())),
    *ZH_ARITHMETIC_RULES,
    *ZH_ROMAN_RULES,
    # An ordinal is read with 二, never 两 (第2名 -> 第二名, 第200名 -> 第二百名); a cardinal 2个 keeps 两.
    rule("ordinal", r"(?<=第)\d{1,12}+(?![\d.,:])", lambda m: zh_cardinal(m.group())),
    rule("two_digit_year", r"(?<![\d.])(\d{2})年(?=\d{1,2}月)", lambda m: zh_digits(m.group(1), yao=False) + "年"),
    rule("version", r"(?<![0-9A-Za-z.])(?P<v>[vV])?(?P<num>\d{1,4}(?:\.\d{1,4}){2,6})(?![0-9A-Za-z]|\.\d)", _version),
    # $1,000-$2,000 -> $1,000到$2,000 (wetext read the hyphen as 负 before the second amount)
    rule(
        "money_range",
        rf"(?P<a>(?:{_CURRENCY_PATTERN})\s*+{_AMOUNT})\s*+[-—–~～〜]\s*+(?=(?:{_CURRENCY_PATTERN})?\s*+\d)",
        r"\g<a>到",
    ),
    rule("thousands_separator", r"(?<![\d.,])\d{1,3}(?:,\d{3})++(?![\d,])", lambda m: m.group().replace(",", "")),
    rule(
        "money",
        r"(?P<cur>HK\$|US\$|RMB|CNY|USD|HKD|EUR|GBP|[¥￥$€£])\s*+(?P<num>\d++(?:,\d{3})*+(?:\.\d++)?+)(?P<mag>万亿|亿|万|千|百万|[kKMB](?![A-Za-z]))?",
        _money,
    ),
    rule(
        "percent_range",
        r"(?<![\d.])(?P<a>\d++(?:\.\d++)?+)%?+\s*+[-—–~～〜至到]\s*+(?P<b>\d++(?:\.\d++)?+)%",
        r"\g<a>%到\g<b>%",
    ),
    rule("dash_range", r"(?<=\d)\s*+[—–~～〜]\s*+(?=\d)", "到"),
    rule("decimal_range", r"(?<![0-9A-Za-z.-])(?P<a>\d++(?:\.\d++)?+)-(?P<b>\d++(?:\.\d++)?+)(?![0-9A-Za-z.-])", _decimal_range),
    # -1.5% -> 负1.5%, which wetext reads 负百分之一点五 (it read -1.5% as 百分之负一点五)
    rule("negative_percent", r"(?<![0-9A-Za-z.%)-])[-−](?=\d++(?:\.\d++)?+%)", "负"),
    rule("leading_decimal_point", r"(?<![0-9A-Za-z.])\.(?=\d)", "0."),
    rule("two_oclock", r"(?<![\d.第])2(?=点(?![\d零一二三四五六七八九十]))", "两"),
    rule("word_hyphen_number", r"(?<=[A-Za-z])-(?=\d)", " "),
    rule("multiply", r"(?<=\d)\s*+[xX*]\s*+(?=\d)", "×"),
    rule("power", r"(?<=\d)\^(\d{1,6}+)", r"的\1次方"),
    rule("plus_suffix", r"(?<=\d)\+(?!\d)", "多"),
    rule("below_zero", r"零下\s*+[-−]", "零下"),
)

# After wetext: digits it left (it gives up on a few inputs) are read as numbers rather than sent as digits.
ZH_LATE_RULES: tuple[Rule, ...] = (rule("leftover_digits", r"[0-9]++", lambda m: zh_cardinal(m.group())),)
