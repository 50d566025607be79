"""The serving Qwen2 tokenizer (tiktoken) on small tokenizer.json files: merge order, ids, added tokens, errors, cache."""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from tokenizer_files import spell, tokenizer_json, write

from service.errors import BundleError
from service.families.cosyvoice2.verify import verify_tokenizer
from service.layers import bpe
from service.layers.qwen_tokenizer import Qwen2Tokenizer

# ids: bytes 0..255, then " t" 256, "he" 257, " the" 258, "th" 259, "in" 260, "er" 261
MERGES = [(" ", "t"), ("h", "e"), (" t", "he"), ("t", "h"), ("i", "n"), ("e", "r")]


def load(tmp_path: Path, data: dict[str, Any], **kwargs: Any) -> Qwen2Tokenizer:
    return Qwen2Tokenizer.load(write(data, tmp_path / "tokenizer.json"), **kwargs)


def test_merges_apply_in_listed_order(tmp_path: Path) -> None:
    tok = load(tmp_path, tokenizer_json(MERGES))
    assert tok.encode(" the") == [258]
    assert tok.encode(" then") == [258, ord("n")]
    assert tok.encode("the") == [ord("t"), 257]  # "he" (merge 1) before "th" (merge 3)
    assert tok.encode("winter") == [ord("w"), 260, ord("t"), 261]
    assert tok.decode(tok.encode(" then winter")) == " then winter"


def test_ids_that_do_not_follow_merge_order(tmp_path: Path) -> None:
    # "th" gets the lowest id and "he" the highest: ranked by id, " the" would split as [" ", "th", "e"].
    ids = {" t": 257, "he": 261, " the": 258, "th": 256, "in": 260, "er": 259}
    tok = load(tmp_path, tokenizer_json(MERGES, ids=ids))
    assert tok.encode(" the") == [258]
    assert tok.encode("the") == [ord("t"), 261]
    assert tok.encode(" then winter") == [258, ord("n"), 32, ord("w"), 260, ord("t"), 259]
    assert tok.decode([258, ord("n"), 261]) == " thenhe"


def test_a_vocabulary_entry_no_merge_makes_is_never_produced(tmp_path: Path) -> None:
    tok = load(tmp_path, tokenizer_json(MERGES, extra_vocab=("hex",)))
    assert tok.encode("hex") == [257, ord("x")]


def test_merges_that_ranked_bpe_cannot_reproduce_are_refused(tmp_path: Path) -> None:
    # `tokenizers` turns "abc" into [a, bc]: (a, bc) is no merge. Ranked BPE would join a + bc into "abc".
    with pytest.raises(BundleError, match="not a listed merge"):
        load(tmp_path, tokenizer_json([("b", "c"), ("a", "b"), ("ab", "c")]))
    # "abc" is first listed as (a, bc), but the pair its BPE reaches, (ab, c), comes after "xy"'s merge.
    with pytest.raises(BundleError, match="out of order"):
        load(tmp_path, tokenizer_json([("a", "b"), ("b", "c"), ("a", "bc"), ("x", "y"), ("ab", "c")]))


def test_added_tokens_split_leftmost_longest_before_bpe(tmp_path: Path) -> None:
    tok = load(tmp_path, tokenizer_json(MERGES, added=(("[x]", False), ("[x]the", False), ("<|endofprompt|>", False))))
    x, x_the, end = 262, 263, 264
    assert tok.encode("[x]the[x] the") == [x_the, x, 258]
    assert tok.encode(" the<|endofprompt|>[x]") == [258, end, x]
    assert tok.encode("<|endofprompt") == list(b"<|endofprompt")  # no added token: its bytes
    assert tok.decode([258, end]) == " the<|endofprompt|>"


def test_text_is_nfc_normalized_and_added_tokens_match_by_their_normalized_flag(tmp_path: Path) -> None:
    tok = load(tmp_path, tokenizer_json(MERGES, added=(("Å", False), ("é", True))))
    raw_a, norm_e = 262, 263
    composed_a = list("Å".encode())
    assert tok.encode("Å") == [raw_a]
    assert tok.encode("A\u030a") == composed_a  # matched on the raw text: the decomposed form is not the token
    assert tok.encode("e\u0301") == [norm_e]  # matched after NFC
    assert tok.encode("ẹ\u0301") == list(unicodedata.normalize("NFC", "ẹ\u0301").encode())


def test_official_cases_are_checked_exactly(tmp_path: Path) -> None:
    tok = load(tmp_path, tokenizer_json(MERGES))
    cases = [{"name": "en", "text": " then", "normalized_sentences": [" then", "the"], "ids": [[258, 110], [116, 257]]}]
    cases[0]["raw_ids"] = [258, 110]
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"cases": cases}), encoding="utf-8")
    assert [c.ok for c in verify_tokenizer(tok, good)] == [True, True]
    cases[0]["ids"] = [[258, 110], [116, 104, 101]]
    cases[0]["raw_ids"] = [32, 116, 104, 101, 110]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cases": cases}), encoding="utf-8")
    assert [c.ok for c in verify_tokenizer(tok, bad)] == [False, False]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["model"].update(type="WordPiece"), "expected BPE"),
        (lambda d: d["model"]["vocab"].pop(spell("A")), "256 byte symbols"),
        (lambda d: d["model"]["vocab"].update({"not bytes": 999}), "not byte-level"),
        (lambda d: d["model"].update(ignore_merges=True), "ignore_merges"),
        (lambda d: d["model"]["merges"].append(["Ġ", "zz"]), "merge 6"),
        (lambda d: d.update(normalizer={"type": "Lowercase"}), "normalizer"),
        (lambda d: d.update(post_processor={"type": "TemplateProcessing"}), "post_processor"),
        (lambda d: d.update(pre_tokenizer={"type": "Whitespace"}), "pre_tokenizer"),
        (lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(pattern={"Regex": r"\p{L}+"}), "every character"),
        (lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(pattern={"Regex": r"(?<x"}), "tiktoken cannot"),
        (lambda d: d["added_tokens"][0].update(lstrip=True), "lstrip"),
        (lambda d: d.pop("model"), "`model`"),
    ],
)
def test_unusable_files_are_bundle_errors(tmp_path: Path, change: Any, message: str) -> None:
    data = json.loads(json.dumps(tokenizer_json(MERGES, added=(("[x]", False),))))
    change(data)
    with pytest.raises(BundleError, match=message):
        load(tmp_path, data)


def test_missing_or_malformed_file_is_a_bundle_error(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="cannot read"):
        Qwen2Tokenizer.load(tmp_path / "tokenizer.json")
    (tmp_path / "broken.json").write_text("{", encoding="utf-8")
    with pytest.raises(BundleError, match="cannot read"):
        Qwen2Tokenizer.load(tmp_path / "broken.json")
    (tmp_path / "list.json").write_text("[]", encoding="utf-8")
    with pytest.raises(BundleError, match="not a JSON object"):
        Qwen2Tokenizer.load(tmp_path / "list.json")


def test_check_result_is_cached_by_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    first = load(tmp_path, tokenizer_json(MERGES), cache_dir=cache)
    records = list(cache.glob("qwen2-tokenizer-*.json"))
    assert [r.name for r in records] == [f"qwen2-tokenizer-{first.sha256}.json"]

    def refuse(*_: object) -> None:
        raise AssertionError("the check ran again")

    monkeypatch.setattr(bpe, "checked_order", refuse)
    assert load(tmp_path, tokenizer_json(MERGES), cache_dir=cache).encode(" then") == [258, ord("n")]
    with pytest.raises(AssertionError, match="ran again"):  # other content, or a damaged record: checked again
        load(tmp_path, tokenizer_json(MERGES[:-1]), cache_dir=cache)
    records[0].write_text("{", encoding="utf-8")
    with pytest.raises(AssertionError, match="ran again"):
        load(tmp_path, tokenizer_json(MERGES), cache_dir=cache)


def test_an_unwritable_cache_only_skips_caching(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("", encoding="utf-8")
    tok = load(tmp_path, tokenizer_json(MERGES), cache_dir=blocker / "cache")
    assert tok.encode(" the") == [258]


# Runs in a fresh interpreter where `tokenizers` and huggingface_hub cannot be imported, as in the serving image.
NO_HF = r"""
import sys
from pathlib import Path

class NoHF:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("tokenizers", "huggingface_hub", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
        return None

sys.meta_path.insert(0, NoHF())
from service.layers.qwen_tokenizer import Qwen2Tokenizer
from service.families.cosyvoice2.verify import verify_tokenizer

checks = list(verify_tokenizer(Qwen2Tokenizer.load(sys.argv[1]), Path(sys.argv[2])))
print(all(c.ok for c in checks), len(checks), [m for m in sys.modules if m.split(".")[0] == "tokenizers"])
"""


def test_serving_and_verify_need_no_tokenizers_package(tmp_path: Path) -> None:
    path = write(tokenizer_json(MERGES), tmp_path / "tokenizer.json")
    cases = [{"name": "en", "text": " the", "normalized_sentences": [" then"], "ids": [[258, 110]], "raw_ids": [258]}]
    (tmp_path / "cases.json").write_text(json.dumps({"cases": cases}), encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-c", NO_HF, str(path), str(tmp_path / "cases.json")],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "2", "[]"]
