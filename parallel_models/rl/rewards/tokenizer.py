"""The reward model's tokenizer: which one it is, whether it is the actor's, and turning the
actor's token ids into reward-model token ids.

Which tokenizer (``resolve_reward_tokenizer``)
    A tokenizer object is used as given; a path is loaded with
    ``parallel_models.tokenizer.load_tokenizer`` (the tokenizer that was saved there, checked
    against its ``tokenizer.json``); ``None`` means the one saved in the reward-model folder.
    On the same-tokenizer fast path (``same_tokenizer=True``, or no actor tokenizer: the ids are
    already the reward model's) the folder need not hold tokenizer files: the actor's tokenizer
    (when given) then stands for the reward model's (BOS for left truncation, its
    ``model_max_length``). Without tokenizer files and without ``same_tokenizer`` the two cannot be
    compared, which is a ``ConfigError`` saying what to set.

Re-tokenization (actor tokenizer != reward tokenizer)
    1. Decode the prompt and the response with the actor tokenizer (``skip_special_tokens=True``:
       BOS/EOS/pad of the actor are dropped).
    2. Rebuild the conversation: the row's ``messages`` when given (the prompt came from a chat
       template), else the decoded prompt as the user turn; the decoded response is the assistant
       turn.
    3. Reward tokenizer with a chat template: ``apply_chat_template(conversation)`` then encode
       without adding special tokens (the template holds them). Without a chat template: plain
       concatenation ``prompt_text + response_text`` encoded with the tokenizer's own special
       tokens.
    4. Over ``max_length`` tokens: ``truncation="left"`` drops tokens from the start (a leading
       BOS is kept) so the end of the response, where the score is read, survives;
       ``"right"`` keeps the first ``max_length`` tokens (the score is then read at the cut).
    No string is rewritten by hand: the only text transforms are the two tokenizers' own decode,
    chat template and encode.

Same tokenizer (``same_tokenizer``): the same object, or the same class, serialized tokenizer,
special tokens and chat template; the name/path is not compared, since a reward model fine-tuned
from the policy keeps the policy's tokenizer under another name.
"""

from __future__ import annotations

from typing import Any

from parallel_models.config import ConfigError
from parallel_models.rl.rewards.inputs import split_prompt_response

TRUNCATION_POLICIES = ("left", "right")

__all__ = ["same_tokenizer", "resolve_reward_tokenizer", "conversations", "retokenize",
           "truncate", "TRUNCATION_POLICIES"]


# ---- tokenizer identity -----------------------------------------------------------------------
def _tokenizer_fingerprint(tok) -> tuple:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        body = backend.to_str()
    else:
        body = sorted(tok.get_vocab().items())
    specials = tuple(getattr(tok, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "unk"))
    return (type(tok).__name__, body, specials, getattr(tok, "chat_template", None))


def same_tokenizer(a, b) -> bool:
    """True when ``a`` and ``b`` turn text into the same ids and render chats alike: the same
    object, or the same class, serialized tokenizer (vocab, merges, normalizer, added tokens),
    special-token ids and chat template."""
    if a is b:
        return True
    if a is None or b is None:
        return False
    return _tokenizer_fingerprint(a) == _tokenizer_fingerprint(b)


def resolve_reward_tokenizer(tokenizer, path: str, actor_tokenizer,
                             same: bool | None) -> tuple[Any, bool]:
    """(the reward model's tokenizer or None, whether the fast path applies); see the module
    docstring. ``path`` is the reward-model folder."""
    from parallel_models.tokenizer import has_tokenizer_files, load_tokenizer

    fast_path_certain = same is True or actor_tokenizer is None
    if tokenizer is not None and not isinstance(tokenizer, str):
        rm_tok = tokenizer
    elif isinstance(tokenizer, str):
        rm_tok = load_tokenizer(tokenizer, what="reward tokenizer (reward.tokenizer)")
    elif has_tokenizer_files(path):
        rm_tok = load_tokenizer(path, what="reward tokenizer")
    elif fast_path_certain:
        rm_tok = actor_tokenizer  # the ids are the actor's; may be None (ids only)
    else:
        raise ConfigError(
            f"{path} holds no tokenizer files, so the actor's tokenizer cannot be compared with "
            "the reward model's: set same_tokenizer=True (reward.same_tokenizer) to score the "
            "actor's token ids as they are, or give the reward model's tokenizer "
            "(reward.tokenizer)")
    if same is None:
        same = actor_tokenizer is None or same_tokenizer(actor_tokenizer, rm_tok)
    if not same and actor_tokenizer is None:
        raise ValueError("same_tokenizer=False needs the actor_tokenizer to decode with")
    return rm_tok, bool(same)


# ---- re-tokenization ---------------------------------------------------------------------------
def conversations(batch: dict, actor_tokenizer, rm_tokenizer) -> list[Any]:
    """What the reward tokenizer encodes per row: a chat (list of messages) when it has a chat
    template, else the concatenated text. Decodes with the actor tokenizer."""
    tok = actor_tokenizer
    if tok is None:
        raise ValueError("re-tokenization needs the actor_tokenizer")
    prompts, responses = split_prompt_response(batch)
    n = len(prompts)
    messages = batch.get("messages")
    if messages is not None and len(messages) != n:
        raise ValueError(f"batch['messages'] has {len(messages)} entries for {n} rows")
    messages = list(messages) if messages is not None else [None] * n
    has_template = bool(getattr(rm_tokenizer, "chat_template", None))
    response_texts = tok.batch_decode(responses, skip_special_tokens=True)
    need_prompt = [i for i in range(n) if not (has_template and messages[i])]
    prompt_texts: list[str | None] = [None] * n
    if need_prompt:
        decoded = tok.batch_decode([prompts[i] for i in need_prompt], skip_special_tokens=True)
        for i, text in zip(need_prompt, decoded):
            prompt_texts[i] = text
    out: list[Any] = []
    for i in range(n):
        if not has_template:
            out.append(prompt_texts[i] + response_texts[i])
            continue
        if messages[i]:
            conv = [{"role": m["role"], "content": m["content"]} for m in messages[i]]
        else:
            conv = [{"role": "user", "content": prompt_texts[i]}]
        conv.append({"role": "assistant", "content": response_texts[i]})
        out.append(conv)
    return out


def retokenize(batch: dict, actor_tokenizer, rm_tokenizer) -> list[list[int]]:
    """The reward tokenizer's ids of every row's conversation (not truncated)."""
    convs = conversations(batch, actor_tokenizer, rm_tokenizer)
    tok = rm_tokenizer
    if convs and isinstance(convs[0], str):
        return [list(x) for x in tok(convs, add_special_tokens=True)["input_ids"]]
    texts = [tok.apply_chat_template(c, tokenize=False) for c in convs]
    return [list(x) for x in tok(texts, add_special_tokens=False)["input_ids"]]


def truncate(ids: list[int], max_length: int, policy: str, bos_token_id: int | None) -> list[int]:
    """``ids`` cut to ``max_length`` tokens: ``"right"`` keeps the first ones, ``"left"`` the last
    ones (and a leading ``bos_token_id``)."""
    m = max_length
    if policy == "right":
        return ids[:m]
    if bos_token_id is not None and ids[0] == bos_token_id and m > 1:
        return [bos_token_id] + ids[len(ids) - (m - 1):]
    return ids[len(ids) - m:]
