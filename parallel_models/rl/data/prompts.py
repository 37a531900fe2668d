"""Prompt data for PPO: a tokenized prompt set and a deterministic, resumable batch loader.

Records come from a JSONL file (one JSON object per line; blank lines skipped), a JSON file
holding a list of objects, a Parquet file (pyarrow), or the built-in prompt set. Each record has
either chat ``messages`` (a list of ``{"role", "content"}``; used when present) or a ``prompt``
text (the key names are options). Tokenization:

* messages: the tokenizer's chat template with ``add_generation_prompt=True`` (rendered to text,
  then encoded without adding special tokens, as ``transformers`` does);
* a plain prompt: wrapped as one user message in the chat template when ``chat_template=True``
  and the tokenizer has one; otherwise encoded as text with the tokenizer's own special tokens
  (a BOS for Llama-like tokenizers).

Prompts longer than ``max_prompt_length`` tokens follow ``truncation``: ``"left"`` keeps the last
tokens (the end of the prompt is where the response starts; a leading BOS is kept) and counts
them in ``num_truncated``; ``"drop"`` leaves them out and counts them in ``num_dropped``;
``"error"`` raises naming the record.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
from typing import Any, Iterator, Sequence

import numpy as np

from parallel_models.config import ConfigError

logger = logging.getLogger(__name__)


class DataError(ConfigError):
    """A prompt file or record that cannot be used; the message names the file and line/row."""


# ---- built-in prompts --------------------------------------------------------------------------
_BUILTIN = [
    "count to five:", "say something happy:", "name a color:", "describe the sea:",
    "greet a friend:", "name an animal:", "say hello:", "describe the sky:",
    "name a fruit:", "tell me a secret:", "sing a song:", "describe a cat:",
    "say goodbye:", "name a city:", "write a word:", "describe the sun:",
    "name a flower:", "say a number:", "describe a tree:", "what is your name?",
    "count to three:", "say something kind:", "name a tool:", "describe the moon:",
    "name a bird:", "say thank you:", "describe rain:", "name a game:",
    "tell a joke:", "say yes or no:", "describe a dog:", "name a drink:",
    "write a poem:", "say something calm:", "name a planet:", "describe a river:",
    "name a food:", "say good morning:", "describe snow:", "name a sport:",
    "spell a word:", "say something loud:", "name a month:", "describe wind:",
    "name a shape:", "say good night:", "describe a house:", "name a season:",
    "repeat after me:", "say something new:", "name a day:", "describe a road:",
    "name an insect:", "say something old:", "describe fire:", "name a letter:",
    "finish this line:", "say something sweet:", "name a fish:", "describe a book:",
    "make a sound:", "say something true:", "name a tree:", "describe the night:",
]


def builtin_prompts() -> list[dict[str, str]]:
    """The default run's 64 short prompts, as records ``{"prompt": text}``."""
    return [{"prompt": p} for p in _BUILTIN]


# ---- reading files -----------------------------------------------------------------------------
def read_records(path: str | os.PathLike) -> list[tuple[str, dict]]:
    """``(where, record)`` pairs from a .jsonl / .json / .parquet file; ``where`` is
    ``"file:line"`` (JSONL), ``"file[index]"`` (JSON) or ``"file row N"`` (Parquet)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file not found: {path}")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as err:  # pragma: no cover - pyarrow is a dependency
            raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") \
                from err
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:  # noqa: BLE001 - pyarrow raises several kinds
            raise DataError(f"{path}: not a readable Parquet file: {err}") from err
        return [(f"{path} row {i}", row) for i, row in enumerate(rows)]
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{err.lineno}: invalid JSON: {err.msg}") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json prompt file must hold a list of objects "
                            f"(use .jsonl for one object per line)")
        out = []
        for i, rec in enumerate(data):
            if not isinstance(rec, dict):
                raise DataError(f"{path}[{i}]: expected a JSON object, got "
                                f"{type(rec).__name__}")
            out.append((f"{path}[{i}]", rec))
        return out
    if path.endswith(".jsonl"):
        out = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{lineno}: invalid JSON: {err.msg} (column "
                                    f"{err.colno})") from None
                if not isinstance(rec, dict):
                    raise DataError(f"{path}:{lineno}: expected a JSON object, got "
                                    f"{type(rec).__name__}")
                out.append((f"{path}:{lineno}", rec))
        return out
    raise DataError(f"{path}: unsupported prompt file type; use .jsonl, .json or .parquet")


def check_record(where: str, rec: dict, prompt_key: str = "prompt",
                 messages_key: str = "messages") -> None:
    """:class:`DataError` naming ``where`` unless ``rec`` has well-formed chat ``messages_key``
    (a non-empty list of ``{"role", "content"}`` strings) or a string ``prompt_key``."""
    messages = rec.get(messages_key)
    if messages is not None:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise DataError(f"{where}: {messages_key!r} must be a non-empty list of "
                            f"{{'role', 'content'}} objects, got {messages!r:.80}")
        for j, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: {messages_key}[{j}] must be an object with "
                                f"string 'role' and 'content', got {m!r:.80}")
        return
    prompt = rec.get(prompt_key)
    if prompt is None:
        raise DataError(f"{where}: record has neither {prompt_key!r} nor {messages_key!r} "
                        f"(data.prompt_key / data.messages_key); its keys: {sorted(rec)}")
    if not isinstance(prompt, str):
        raise DataError(f"{where}: {prompt_key!r} must be a string, got {type(prompt).__name__}")


# ---- dataset -----------------------------------------------------------------------------------
class PromptDataset:
    """Tokenized prompts. ``ds[i]`` is ``{"input_ids": list[int], "record": dict}``.

    ``path=None`` uses :func:`builtin_prompts`; ``records=`` gives the records directly.
    """

    def __init__(self, path: str | os.PathLike | None, tokenizer, prompt_key: str = "prompt",
                 messages_key: str = "messages", max_prompt_length: int | None = None,
                 truncation: str = "left", chat_template: bool = False,
                 records: Sequence[dict] | None = None):
        if truncation not in ("left", "drop", "error"):
            raise ValueError(f"truncation must be 'left', 'drop' or 'error', got {truncation!r}")
        if max_prompt_length is not None and max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        self.path = None if path is None else os.fspath(path)
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.messages_key = messages_key
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.chat_template = chat_template
        if records is not None:
            located = [(f"records[{i}]", r) for i, r in enumerate(records)]
        elif self.path is None:
            located = [(f"builtin[{i}]", r) for i, r in enumerate(builtin_prompts())]
        else:
            located = read_records(self.path)
        source = self.path or ("records" if records is not None else "built-in prompts")
        if not located:
            raise DataError(f"{source}: no prompt records")

        self.input_ids: list[list[int]] = []
        self.records: list[dict] = []
        self.num_truncated = 0
        self.num_dropped = 0
        for where, rec in located:
            ids = self._encode(where, rec)
            if max_prompt_length is not None and len(ids) > max_prompt_length:
                if truncation == "error":
                    raise DataError(f"{where}: prompt has {len(ids)} tokens, more than "
                                    f"max_prompt_length={max_prompt_length} "
                                    "(data.truncation=error)")
                if truncation == "drop":
                    self.num_dropped += 1
                    continue
                ids = self._truncate_left(ids, max_prompt_length)
                self.num_truncated += 1
            self.input_ids.append(ids)
            self.records.append(rec)
        if self.num_truncated or self.num_dropped:
            logger.warning("%s: %d prompts longer than %d tokens were %s", source,
                           self.num_truncated or self.num_dropped, max_prompt_length,
                           "left-truncated" if truncation == "left" else "dropped")
        if not self.input_ids:
            raise DataError(f"{source}: all {len(located)} prompts are longer than "
                            f"max_prompt_length={max_prompt_length} and were dropped")

    # -- encoding --
    def _encode(self, where: str, rec: dict) -> list[int]:
        tok = self.tokenizer
        check_record(where, rec, self.prompt_key, self.messages_key)
        messages = rec.get(self.messages_key)
        if messages is not None:
            if not getattr(tok, "chat_template", None):
                raise DataError(f"{where}: chat {self.messages_key!r} need a tokenizer with a "
                                "chat template, and this tokenizer has none")
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return list(tok(text, add_special_tokens=False)["input_ids"])
        prompt = rec[self.prompt_key]
        if self.chat_template and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
            return list(tok(text, add_special_tokens=False)["input_ids"])
        return list(tok(prompt)["input_ids"])

    def _truncate_left(self, ids: list[int], limit: int) -> list[int]:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is not None and ids and ids[0] == bos and limit > 1:
            return [bos] + ids[len(ids) - (limit - 1):]
        return ids[len(ids) - limit:]

    # -- access --
    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.input_ids[i], "record": self.records[i]}

    def stats(self) -> dict[str, float]:
        lengths = [len(x) for x in self.input_ids]
        return {"num_prompts": len(lengths), "num_truncated": self.num_truncated,
                "num_dropped": self.num_dropped, "prompt_length/mean": float(np.mean(lengths)),
                "prompt_length/max": float(max(lengths))}


# ---- loader ------------------------------------------------------------------------------------
class PromptLoader:
    """Endless batches of ``batch_size`` prompts, deterministic given ``seed``.

    Epoch ``e`` visits the dataset in the order ``permutation(seed, e)`` (a fresh shuffle every
    epoch; identity order when ``shuffle=False``). A batch that reaches the end of an epoch is
    completed from the next one, so every batch has exactly ``batch_size`` prompts. The state is
    ``(epoch, position)`` plus the seed; since each epoch's order is derived from ``(seed, epoch)``
    alone, :meth:`load_state_dict` resumes the exact sequence of batches.

    :meth:`next_batch` returns ``{"input_ids": list[list[int]], "records": list[dict],
    "indices": list[int], "epoch": int}``; iterating yields the same dicts forever.
    """

    def __init__(self, dataset: PromptDataset | Sequence[dict], batch_size: int,
                 shuffle: bool = True, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) == 0:
            raise ValueError("PromptLoader: the dataset is empty")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: np.ndarray | None = None
        if batch_size > len(dataset):
            logger.warning("PromptLoader: batch_size %d > %d prompts: batches repeat prompts",
                           batch_size, len(dataset))

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            n = len(self.dataset)
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
                self._order = rng.permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> dict:
        indices: list[int] = []
        epoch = self.epoch
        while len(indices) < self.batch_size:
            order = self._epoch_order(self.epoch)
            take = min(self.batch_size - len(indices), len(order) - self.position)
            indices.extend(int(i) for i in order[self.position:self.position + take])
            self.position += take
            if self.position >= len(order):
                self.epoch += 1
                self.position = 0
        items = [self.dataset[i] for i in indices]
        return {"input_ids": [it["input_ids"] for it in items],
                "records": [it["record"] for it in items], "indices": indices, "epoch": epoch}

    def __iter__(self) -> Iterator[dict]:
        while True:
            yield self.next_batch()

    def __len__(self) -> int:
        """Batches per epoch (rounded up)."""
        return -(-len(self.dataset) // self.batch_size)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "batch_size": self.batch_size,
                "dataset_size": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle),
                          ("dataset_size", len(self.dataset))):
            if key in state and state[key] != mine:
                raise DataError(f"the checkpoint's prompt loader was saved with {key}="
                                f"{state[key]!r}, this run's data has {key}={mine!r}: the resumed "
                                "run would not see the same prompts (resume with the data "
                                "settings of the run: data.path, data.task, data.seed, "
                                "data.shuffle)")
        if not 0 <= int(state["position"]) < len(self.dataset):
            raise ValueError(f"PromptLoader state: position {state['position']} is outside the "
                             f"dataset of {len(self.dataset)} prompts")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def prompt_caps(batch: dict, rows: Sequence[int], data_cfg, limit: int) -> list[int]:
    """The response caps of ``rows`` of a :meth:`PromptLoader.next_batch` batch, read from each
    record's ``data_cfg.max_new_tokens_key`` field; a missing or bad value is a
    :class:`DataError` naming the file, the prompt and the key."""
    key = data_cfg.max_new_tokens_key
    source = data_cfg.path or (f"data.task={data_cfg.task}" if data_cfg.task else
                               "built-in prompts")
    caps = []
    for i in rows:
        value = batch["records"][i].get(key)
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and \
                float(value).is_integer() and 1 <= value <= limit:
            caps.append(int(value))
            continue
        raise DataError(f"{source}: prompt {batch['indices'][i]}: data.max_new_tokens_key "
                        f"{key!r} = {value!r}; it must be an integer in 1..{limit} "
                        "(rollout.max_new_tokens)")
    return caps


__all__ = ["PromptDataset", "PromptLoader", "DataError", "builtin_prompts", "prompt_caps",
           "read_records", "check_record"]


def prompt_datasets(data_cfg, tokenizer) -> tuple[PromptDataset, PromptDataset | None]:
    """The training prompts and the validation prompts (None without a validation set) of the
    ``data`` config section: its files, or a built-in task's splits (``data.task``)."""
    from parallel_models.rl.data.tasks import task_records

    d = data_cfg
    common = dict(prompt_key=d.prompt_key, messages_key=d.messages_key,
                  max_prompt_length=d.max_prompt_length, truncation=d.truncation,
                  chat_template=d.chat_template)
    if d.task:
        train = PromptDataset(None, tokenizer, records=task_records(d.task, "train", seed=d.seed),
                              **common)
    else:
        train = PromptDataset(d.path, tokenizer, **common)
    if d.val_path:
        val = PromptDataset(d.val_path, tokenizer, **common)
    elif d.task:
        val = PromptDataset(None, tokenizer, records=task_records(d.task, "val", seed=d.seed),
                            **common)
    else:
        val = None
    return train, val
