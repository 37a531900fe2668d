"""The load-time tokenizer check (issue 30 item 14): a tokenizer that transformers loads with
another normalizer than the saved ``tokenizer.json`` is refused even where the one probe text of
before encodes alike; the oracle is ``tokenizers.Tokenizer.from_file(tokenizer.json)`` itself."""

from __future__ import annotations

import json

import pytest

from tests.helpers import reward_model_checks as rc


def _saved_with(folder, normalizer):
    """The helpers' lowercasing Metaspace BPE (the reward model's of the issue's repro) with
    ``normalizer``, saved next to a Qwen2 config; returns its tokenizer.json path."""
    from transformers import Qwen2Config

    tok = rc.build_rm_lowercase_bpe_tokenizer()
    tok.backend_tokenizer.normalizer = normalizer
    Qwen2Config(vocab_size=251).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder / "tokenizer.json")


def _loaded_with(tokenizer_json, normalizer):
    """What a loader that rebuilds the normalizer would give: the saved pipeline, another
    normalizer."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_file(tokenizer_json)
    backend.normalizer = normalizer
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def _old_probe_agrees(tok, tokenizer_json) -> bool:
    from tokenizers import Tokenizer

    from parallel_models.tokenizer import PROBE_TEXT

    saved = Tokenizer.from_file(tokenizer_json)
    return list(tok(PROBE_TEXT, add_special_tokens=False)["input_ids"]) == \
        saved.encode(PROBE_TEXT, add_special_tokens=False).ids


@pytest.mark.parametrize("case", ["compatibility forms (NFKC)", "leading/trailing whitespace",
                                  "decomposed accents (NFC)"])
def test_a_normalizer_the_old_probe_missed_is_refused(tmp_path, case):
    from tokenizers import normalizers as n

    from parallel_models.config import ConfigError
    from parallel_models.tokenizer import check_matches_tokenizer_json

    saved_norm, loaded_norm = {
        "compatibility forms (NFKC)": (n.Sequence([n.NFKC(), n.Lowercase()]), n.Lowercase()),
        "leading/trailing whitespace": (n.Sequence([n.Strip(), n.Lowercase()]), n.Lowercase()),
        "decomposed accents (NFC)": (n.Sequence([n.NFC(), n.Lowercase()]), n.Lowercase()),
    }[case]
    tokenizer_json = _saved_with(tmp_path / "rm", saved_norm)
    wrong = _loaded_with(tokenizer_json, loaded_norm)
    assert _old_probe_agrees(wrong, tokenizer_json)  # what let it through before
    with pytest.raises(ConfigError, match="does not match the saved .*tokenizer.json: it encodes"):
        check_matches_tokenizer_json(wrong, tokenizer_json, str(tmp_path / "rm"))
    # the right pipeline passes
    check_matches_tokenizer_json(_loaded_with(tokenizer_json, saved_norm), tokenizer_json,
                                 str(tmp_path / "rm"))


def test_saved_tokenizers_load_and_pass_every_probe(tmp_path):
    """The issue's reward tokenizer and the built-in one load by path and encode every probe
    text as tokenizers does; a class that rebuilds the pipeline is still refused."""
    from tokenizers import Tokenizer

    from parallel_models.config import ConfigError
    from parallel_models.tokenizer import PROBE_TEXTS, build_builtin_tokenizer, load_tokenizer

    rm = tmp_path / "rm"
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=251).save_pretrained(rm)
    rc.build_rm_lowercase_bpe_tokenizer().save_pretrained(rm)
    builtin = tmp_path / "builtin"
    build_builtin_tokenizer().save_pretrained(builtin)
    for folder in (rm, builtin):
        tok = load_tokenizer(str(folder))
        saved = Tokenizer.from_file(str(folder / "tokenizer.json"))
        for text in PROBE_TEXTS:
            assert list(tok(text)["input_ids"]) == saved.encode(text).ids, (folder.name, text)
    cfg_path = rm / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="Qwen2Tokenizer.*does not match"):
        load_tokenizer(str(rm))
