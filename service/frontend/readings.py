"""Number readings used by the normalization rules: Chinese digit strings and cardinals, English decades."""

from __future__ import annotations

ZH_DIGITS = "零一二三四五六七八九"
_ZH_SMALL_UNITS = ("", "十", "百", "千")
_ZH_BIG_UNITS = ("", "万", "亿", "万亿")
_EN_ONES = ("", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_EN_TENS_PLURAL = ("", "tens", "twenties", "thirties", "forties", "fifties", "sixties", "seventies", "eighties", "nineties")
_EN_TEENS = ("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
_EN_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")


def zh_digits(digits: str, yao: bool = True) -> str:
    """Read ASCII digits one by one (`110` -> 幺幺零 with yao, 一一零 without); other characters are kept."""
    one = "幺" if yao else "一"
    return "".join(one if ch == "1" else ZH_DIGITS[int(ch)] if "0" <= ch <= "9" else ch for ch in digits)


def zh_cardinal(digits: str) -> str:
    """Chinese cardinal of a non-negative ASCII integer below 10^16 (`1012` -> 一千零一十二, `12` -> 十二)."""
    value = digits.lstrip("0")
    if not value:
        return "零"
    if len(value) > 16:
        return zh_digits(value)
    groups = [value[max(0, i - 4) : i] for i in range(len(value), 0, -4)]
    parts: list[str] = []
    need_zero = False
    for idx in range(len(groups) - 1, -1, -1):
        group = groups[idx].rjust(4, "0") if idx < len(groups) - 1 else groups[idx]
        if int(group) == 0:
            need_zero = bool(parts)
            continue
        if parts and (need_zero or group[0] == "0"):
            parts.append("零")
        parts.append(_zh_group(group.lstrip("0")) + _ZH_BIG_UNITS[idx])
        need_zero = False
    text = "".join(parts)
    return text[1:] if text.startswith("一十") else text


def _zh_group(group: str) -> str:
    """Reading of 1..9999 without leading zeros (zeros inside are read once)."""
    out: list[str] = []
    pending_zero = False
    for pos, ch in enumerate(group):
        unit = _ZH_SMALL_UNITS[len(group) - pos - 1]
        if ch == "0":
            pending_zero = True
            continue
        if pending_zero:
            out.append("零")
            pending_zero = False
        out.append(ZH_DIGITS[int(ch)] + unit)
    return "".join(out)


def en_digits(digits: str) -> str:
    """English digit-by-digit reading (`101` -> `one zero one`)."""
    names = ("zero", *_EN_ONES[1:])
    return " ".join(names[int(ch)] for ch in digits if "0" <= ch <= "9")


def en_under_100(n: int) -> str:
    """English words for 0..99 (`42` -> forty-two)."""
    if n < 10:
        return "zero" if n == 0 else _EN_ONES[n]
    if n < 20:
        return _EN_TEENS[n - 10]
    tens, ones = divmod(n, 10)
    return _EN_TENS[tens] + (f"-{_EN_ONES[ones]}" if ones else "")


def en_decade(digits: str) -> str:
    """Decade words for `1990`/`90` style numbers ending in 0 (`1990` -> nineteen nineties, `2000` -> two thousands)."""
    tens = int(digits[-2])
    if len(digits) == 2:
        return _EN_TENS_PLURAL[tens]
    century = int(digits[:-2])
    if tens == 0:
        return f"{en_under_100(century // 10)} thousands" if century % 10 == 0 else f"{en_under_100(century)} hundreds"
    return f"{en_under_100(century)} {_EN_TENS_PLURAL[tens]}"


_EN_ORDINAL_WORDS = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth", "nine": "ninth",
                     "twelve": "twelfth"}  # fmt: skip


def en_ordinal(cardinal: str) -> str:
    """Ordinal of English cardinal words (`twenty-one` -> twenty-first, `forty` -> fortieth)."""
    head, sep, last = cardinal.rpartition("-") if "-" in cardinal else cardinal.rpartition(" ")
    if last in _EN_ORDINAL_WORDS:
        last = _EN_ORDINAL_WORDS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return head + sep + last


def zh_decimal(number: str) -> str:
    """Chinese reading of an ASCII decimal like `3.14` (三点一四) or integer (`12` -> 十二)."""
    whole, _, frac = number.partition(".")
    return zh_cardinal(whole) + ("点" + zh_digits(frac, yao=False) if frac else "")
