"""Tokenizers of the RL stack: loading a saved tokenizer faithfully (``load_tokenizer``, the one
loader the trainer, the reward model and the rollout server use), and the small character-level
tokenizer made locally (no download) for the built-in default run.

Loading
    ``AutoTokenizer`` in transformers 5.x may build the tokenizer class of the folder's *model
    config* (e.g. ``Qwen2Tokenizer`` for a Qwen2 config) and rebuild its pipeline from the vocab,
    ignoring the saved ``tokenizer.json`` (its normalizer, pre-tokenizer, decoder): a model saved
    with its own tokenizer is then fed other ids, without an error. ``load_tokenizer`` loads what
    was saved instead: the class that ``tokenizer_config.json`` names, else the saved
    ``tokenizer.json`` as a ``PreTrainedTokenizerFast``, else ``AutoTokenizer``; and where a
    ``tokenizer.json`` exists it checks that the loaded tokenizer encodes and decodes probe texts
    (mixed case, accents composed and decomposed, compatibility forms, whitespace runs: what
    normalizers change) exactly as ``tokenizers.Tokenizer.from_file`` of that file does (a
    ``ConfigError`` naming the folder otherwise).

Built-in tokenizer

One token per character: lowercase letters, digits, space, newline and ASCII punctuation, plus
the special tokens ``<pad>`` (0), ``<s>`` (1, BOS), ``</s>`` (2, EOS) and ``<unk>`` (3, for
characters outside the vocabulary). Text is NFKD-normalized, accents stripped and lowercased
before it is split, so ``"Héllo"`` encodes like ``"hello"``; text made of vocabulary characters
decodes back exactly. Encoding adds BOS (like Llama tokenizers). The chat template renders

    <s>user: {content}\n ... assistant: {content}</s>\n ... assistant:␣   (generation prompt)

It is a ``transformers.PreTrainedTokenizerFast``: ``save_pretrained`` writes it, and
``load_tokenizer(folder)`` loads it back.
"""

from __future__ import annotations

import json
import string

from parallel_models.config import ConfigError

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARACTERS = string.ascii_lowercase + string.digits + " \n" + string.punctuation

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def builtin_vocab() -> dict[str, int]:
    """Token -> id: the special tokens first, then one entry per character."""
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    return {tok: i for i, tok in enumerate(tokens)}


def build_builtin_tokenizer(model_max_length: int = 512):
    """The built-in character tokenizer as a ``PreTrainedTokenizerFast`` (74 tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    vocab = builtin_vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFKD(), normalizers.StripAccents(),
                                           normalizers.Lowercase()])
    # every character (newline included) is its own pre-token, kept as is
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate, no spaces between tokens
    tok.post_processor = TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                            special_tokens=[(BOS, vocab[BOS])])
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        chat_template=CHAT_TEMPLATE, model_max_length=model_max_length,
        clean_up_tokenization_spaces=False, padding_side="left")


def builtin_tokenizer_note(texts, source: str) -> str | None:
    """A line saying that the built-in tokenizer changes ``texts`` (user prompts from
    ``source``): how many of them its normalizer rewrites (lowercased, accents stripped) and how
    to keep them as written; None when it rewrites none."""
    normalizer = build_builtin_tokenizer().backend_tokenizer.normalizer
    changed = [t for t in texts if normalizer.normalize_str(t) != t]
    if not changed:
        return None
    example = next((t for t in changed), "")[:40]
    return (f"{source}: the built-in character tokenizer lowercases text and strips accents, "
            f"so {len(changed)} of {len(texts)} prompts reach the model changed (e.g. "
            f"{example!r} -> {normalizer.normalize_str(example)!r}); set model.path (or "
            "model.tokenizer) to a model whose tokenizer keeps case")


# ---- loading a saved tokenizer ----------------------------------------------------------------
# mixed case, digits, punctuation, runs of spaces, a tab and a newline, accents, CJK and an emoji:
# the parts of the text that normalizers, pre-tokenizers and byte fallbacks treat differently
PROBE_TEXT = ("Hello World! The QUICK brown fox, 12 + 345 = 357.\n\tcafé naïve Über  spaces   "
              "end; 日本語 🙂 <tag> x=y_z")
# what the check encodes (each alone, with and without the special tokens): PROBE_TEXT, then text
# aimed at the normalizer: composed and decomposed accents (NFC / NFD), compatibility forms that
# NFKC / NFKD fold (full-width letters, a ligature, superscripts, an ideographic space), case
# pairs that change length when lowercased (ß, İ), leading and trailing whitespace, non-breaking
# spaces, CRLF and whitespace runs of every kind
PROBE_TEXTS = (
    PROBE_TEXT,
    "  Leading and trailing  ",
    "ÀÉÎÕÜ àéîõü Ça Ñandú e\u0301te\u0301 A\u0300",
    "ＨＥＬＬＯ ｗｏｒｌｄ ﬁne ﬂow x² ①\u3000Straße İstanbul ǅemal",
    "tab\tand\t\ttabs\r\nCRLF\u00a0nbsp\u2003em   three\n\n\nnewlines ",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "spiece.model")


def _tokenizer_file(path: str, name: str) -> str | None:
    """The local path of ``name`` in the folder (or hub repo) ``path``; None when absent."""
    from transformers.utils import cached_file

    try:
        return cached_file(path, name, _raise_exceptions_for_missing_entries=False)
    except Exception:  # noqa: BLE001 - not a folder / offline: AutoTokenizer reports it below
        return None


def has_tokenizer_files(path: str) -> bool:
    """Whether the folder (or hub repo) ``path`` holds any tokenizer file."""
    return any(_tokenizer_file(path, name) for name in TOKENIZER_FILES)


def load_tokenizer(path: str, what: str = "tokenizer"):
    """The tokenizer saved in ``path`` (a folder or an HF hub id), as it was saved.

    The class named in ``tokenizer_config.json`` (``tokenizer_class``); without one, the saved
    ``tokenizer.json`` as a ``PreTrainedTokenizerFast``; with neither, ``AutoTokenizer``. When
    a ``tokenizer.json`` exists the loaded tokenizer must encode :data:`PROBE_TEXTS` to the same
    ids and decode them to the same text as that file does; ``ConfigError`` (naming ``path``)
    otherwise, and when nothing loads. ``what`` names the tokenizer in errors.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    config_file = _tokenizer_file(path, "tokenizer_config.json")
    tokenizer_json = _tokenizer_file(path, "tokenizer.json")
    named = None
    if config_file:
        try:
            with open(config_file, encoding="utf-8") as f:
                named = json.load(f).get("tokenizer_class")
        except (OSError, ValueError, AttributeError) as err:
            raise ConfigError(f"{config_file}: not a readable tokenizer config "
                              f"({type(err).__name__}: {err})") from err
    try:
        cls = tokenizer_class_from_name(named) if named else None
        if named and cls is None:
            raise ConfigError(f"tokenizer_class {named!r} (in {config_file}) is not a tokenizer "
                              "class of this transformers version")
        if cls is None:
            cls = PreTrainedTokenizerFast if tokenizer_json else AutoTokenizer
        tok = cls.from_pretrained(path)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"cannot load the {what} from {path!r} ({type(err).__name__}: "
                          f"{err})") from err
    if tokenizer_json:
        check_matches_tokenizer_json(tok, tokenizer_json, path, what)
    return tok


def check_matches_tokenizer_json(tok, tokenizer_json: str, path: str,
                                 what: str = "tokenizer") -> None:
    """``ConfigError`` unless ``tok`` encodes each of :data:`PROBE_TEXTS` (with and without the
    special tokens) to the ids ``tokenizers.Tokenizer.from_file(tokenizer_json)`` gives, and
    decodes those ids to the same text."""
    from tokenizers import Tokenizer

    saved = Tokenizer.from_file(tokenizer_json)
    problem = None
    for text in PROBE_TEXTS:
        for specials in (False, True):
            want = saved.encode(text, add_special_tokens=specials).ids
            got = list(tok(text, add_special_tokens=specials)["input_ids"])
            if got != want:
                first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                             min(len(got), len(want)))
                problem = (f"encodes the probe text {text!r} "
                           f"({'with' if specials else 'without'} special tokens) to "
                           f"{got[first:first + 8]} where it gives {want[first:first + 8]} (from "
                           f"token {first})")
                break
        if problem:
            break
        want_text = saved.decode(want, skip_special_tokens=False)
        got_text = tok.decode(want, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if got_text != want_text:
            problem = f"decodes the probe ids to {got_text!r} where it gives {want_text!r}"
            break
    if problem:
        raise ConfigError(
            f"{path}: the {what} transformers loads ({type(tok).__name__}) does not match the "
            f"saved {tokenizer_json}: it {problem}. Set \"tokenizer_class\" in "
            "tokenizer_config.json to the class that was saved (\"TokenizersBackend\" uses "
            "tokenizer.json as it is), or pass the tokenizer object")


__all__ = ["build_builtin_tokenizer", "builtin_vocab", "builtin_tokenizer_note", "load_tokenizer",
           "has_tokenizer_files", "check_matches_tokenizer_json", "PROBE_TEXT", "PROBE_TEXTS",
           "CHARACTERS", "SPECIAL_TOKENS", "CHAT_TEMPLATE"]
