"""A small character-level tokenizer made locally (no download) for the built-in default run.

One token per character: lowercase letters, digits, space, newline and ASCII punctuation, plus
the special tokens ``<pad>`` (0), ``<s>`` (1, BOS), ``</s>`` (2, EOS) and ``<unk>`` (3, for
characters outside the vocabulary). Text is NFKD-normalized, accents stripped and lowercased
before it is split, so ``"Héllo"`` encodes like ``"hello"``; text made of vocabulary characters
decodes back exactly. Encoding adds BOS (like Llama tokenizers). The chat template renders

    <s>user: {content}\n ... assistant: {content}</s>\n ... assistant:␣   (generation prompt)

It is a ``transformers.PreTrainedTokenizerFast``: ``save_pretrained`` writes it, and
``AutoTokenizer.from_pretrained(folder)`` loads it back.
"""

from __future__ import annotations

import string

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


__all__ = ["build_builtin_tokenizer", "builtin_vocab", "CHARACTERS", "SPECIAL_TOKENS",
           "CHAT_TEMPLATE"]
