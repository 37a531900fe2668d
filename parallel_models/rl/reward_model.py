"""Reward model role: a frozen Value RmPad model (any TP/PP) loaded from an HF
``*ForSequenceClassification`` checkpoint, with its own tokenizer, offloaded to host memory between
calls.

Input
    The PPO batch of the actor (see ``parallel_models.rl.roles``): ``sequences [N, L]``,
    ``attention_mask [N, L]``, ``prompt_lengths [N]`` and ``response_mask`` (``[N, R]`` over the
    last ``R`` columns, or ``[N, L]`` over the whole row); the valid tokens of a row are the prompt
    (its first ``prompt_lengths`` valid tokens) followed by the response, so left-padded,
    right-padded and PPO (left-padded prompt + right-padded response) layouts all work. Or a packed
    batch: ``input_ids [T]``, ``cu_seqlens [N+1]`` and ``prompt_lengths [N]`` (or a packed
    ``response_mask [T]``). Optionally ``messages``: one structured chat prompt (list of
    ``{"role", "content"}``) or ``None`` per row.

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
       Truncated rows are counted in ``metrics["reward/truncated"]``.
    No string is rewritten by hand: the only text transforms are the two tokenizers' own decode,
    chat template and encode.

    Same tokenizer (the same object, or the same class, serialized tokenizer, special tokens and
    chat template; the name/path is not compared, since a reward model fine-tuned from the policy
    keeps the policy's tokenizer under another name): no decode and no encode at all; the actor's
    valid token ids are scored as they are (fast path). ``same_tokenizer=`` forces either path.

Scoring
    The RM-token sequences are packed (RmPad, no padding), cut into microbatches of at most
    ``micro_batch_tokens`` tokens (one sequence always fits), run through
    ``parallel_models.pipeline.forward_only`` (megatron's schedules; the last pipeline stage's
    scores are broadcast to every PP rank) and read at each sequence's last token, as transformers'
    ``*ForSequenceClassification`` pools (its rightmost non-pad token). ``score`` returns
    ``float32 [N]`` on the CPU, the same on every rank of the model-parallel group.
    ``token_level_rewards`` puts each score on the actor response's last valid token.

Parallelism
    The reward model is built in the *current* parallel state: in a PPO run it shares the actor's
    tensor-parallel group (and pipeline size). ``reward.tensor_parallel_size`` /
    ``reward.pipeline_parallel_size`` must therefore equal the actor's for now; a different value
    is a ``ConfigError`` (a separate RM process group is future work).

Offload
    ``offload()`` moves every parameter and buffer to host memory (pinned, reused across calls,
    where CUDA is present) and frees the GPU copies; ``onload()`` brings them back. ``score`` runs
    on the compute device and restores the previous state afterwards. ``offload=True`` (automatic):
    the weights live on the host from set-up on and go to the GPU only while scoring;
    ``offload="auto"``: automatic where CUDA is present, resident on a CPU-only machine (there is
    no device memory to free); ``offload=False``: only explicit ``offload()``/``onload()``.
    On the CPU the compute device *is* the host: ``offload()`` then moves the tensors to fresh
    host storage and keeps the same bookkeeping (``is_offloaded``), so the code path is exercised
    without a GPU.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from parallel_models.config import ConfigError
from parallel_models.utils.offload import Offloader

logger = logging.getLogger(__name__)

TRUNCATION_POLICIES = ("left", "right")

__all__ = ["RewardModel", "same_tokenizer", "split_prompt_response", "valid_sequences",
           "place_scores", "TRUNCATION_POLICIES"]


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


# ---- batch layouts ------------------------------------------------------------------------------
def _is_packed(batch: dict) -> bool:
    ids = batch.get("input_ids")
    return "sequences" not in batch and ids is not None and ids.dim() == 1


def _padded_ids(batch: dict) -> torch.Tensor:
    seqs = batch.get("sequences", batch.get("input_ids"))
    if seqs is None or seqs.dim() != 2:
        raise ValueError("reward batch needs 'sequences' [N, L] (padded) or 'input_ids' [T] + "
                         f"'cu_seqlens' [N+1] (packed); got keys {sorted(batch)}")
    return seqs


def valid_sequences(batch: dict) -> list[list[int]]:
    """The valid token ids of every row (prompt + response, padding removed)."""
    if _is_packed(batch):
        ids = batch["input_ids"].tolist()
        cu = _cu_seqlens(batch)
        return [ids[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]
    seqs = _padded_ids(batch)
    mask = batch.get("attention_mask")
    mask = torch.ones_like(seqs, dtype=torch.bool) if mask is None else mask.bool()
    return [row[m].tolist() for row, m in zip(seqs.cpu(), mask.cpu())]


def _cu_seqlens(batch: dict) -> list[int]:
    if "cu_seqlens" not in batch:
        raise ValueError("a packed reward batch (1-D 'input_ids') needs 'cu_seqlens' [N+1]")
    cu = [int(x) for x in batch["cu_seqlens"].tolist()]
    if cu[0] != 0 or cu[-1] != batch["input_ids"].numel() or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens {cu[:8]}... must rise from 0 to the token count "
                         f"{batch['input_ids'].numel()}")
    return cu


def _prompt_lengths(batch: dict, lengths: list[int]) -> list[int]:
    """Valid prompt tokens per row: ``prompt_lengths``, else derived from ``response_mask``."""
    n = len(lengths)
    pl = batch.get("prompt_lengths")
    resp = batch.get("response_mask")
    if pl is not None:
        out = [int(x) for x in torch.as_tensor(pl).reshape(-1).tolist()]
    elif resp is None:
        raise ValueError("cannot tell prompt from response: the batch needs 'prompt_lengths' or "
                         "'response_mask'")
    elif _is_packed(batch):
        cu = _cu_seqlens(batch)
        r = resp.reshape(-1).bool().cpu()
        out = [int((~r[cu[i]:cu[i + 1]]).sum()) for i in range(n)]
    else:
        seqs = _padded_ids(batch)
        mask = batch.get("attention_mask")
        mask = torch.ones_like(seqs, dtype=torch.bool) if mask is None else mask.bool()
        L, R = seqs.shape[1], resp.shape[1]
        if R == L:
            out = (mask & ~resp.bool()).sum(-1).tolist()
        else:
            out = mask[:, :L - R].sum(-1).tolist()
    if len(out) != n:
        raise ValueError(f"prompt_lengths has {len(out)} entries for {n} sequences")
    for i, (p, length) in enumerate(zip(out, lengths)):
        if not 0 <= p <= length:
            raise ValueError(f"row {i}: prompt_lengths={p} but the row has {length} valid tokens")
    return out


def _response_counts(batch: dict, n: int) -> list[int] | None:
    resp = batch.get("response_mask")
    if resp is None:
        return None
    if _is_packed(batch):
        cu = _cu_seqlens(batch)
        r = resp.reshape(-1).bool().cpu()
        return [int(r[cu[i]:cu[i + 1]].sum()) for i in range(n)]
    return [int(x) for x in resp.bool().sum(-1).tolist()]


def split_prompt_response(batch: dict) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, response ids) per row, in the actor's vocabulary, padding removed."""
    seqs = valid_sequences(batch)
    pls = _prompt_lengths(batch, [len(s) for s in seqs])
    counts = _response_counts(batch, len(seqs))
    prompts, responses = [], []
    for i, (s, p) in enumerate(zip(seqs, pls)):
        if counts is not None and len(s) - p != counts[i]:
            raise ValueError(f"row {i}: {len(s)} valid tokens - {p} prompt tokens != "
                             f"{counts[i]} response tokens in response_mask; the valid tokens of a "
                             "row must be its prompt followed by its response")
        prompts.append(s[:p])
        responses.append(s[p:])
    return prompts, responses


def _last_true(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a 2-D mask: (has any, index of the last True)."""
    m = mask.bool()
    width = m.shape[-1]
    idx = torch.arange(width, device=m.device).expand_as(m)
    last = torch.where(m, idx, torch.full_like(idx, -1)).max(-1).values
    return last >= 0, last.clamp(min=0)


def place_scores(scores: torch.Tensor, batch: dict) -> torch.Tensor:
    """Token-level rewards: each sequence's score on its response's last valid token, zeros
    elsewhere (float32). Padded batches: shaped like ``response_mask`` (``[N, R]`` or ``[N, L]``,
    any padding side). Packed batches: ``[T]``, at the last ``response_mask`` token of each
    sequence, or (without a mask) its last token when it has a response (``prompt_lengths``).
    A row with an empty response gets no reward token (nothing to put it on)."""
    scores = torch.as_tensor(scores, dtype=torch.float32).reshape(-1)
    if _is_packed(batch):
        cu = _cu_seqlens(batch)
        n = len(cu) - 1
        if scores.numel() != n:
            raise ValueError(f"{scores.numel()} scores for {n} packed sequences")
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32,
                          device=batch["input_ids"].device)
        resp = batch.get("response_mask")
        if resp is not None:
            r = resp.reshape(-1).bool().cpu()
            for i in range(n):
                pos = torch.nonzero(r[cu[i]:cu[i + 1]]).flatten()
                if pos.numel():
                    out[cu[i] + int(pos[-1])] = scores[i]
            return out
        lengths = [cu[i + 1] - cu[i] for i in range(n)]
        pls = _prompt_lengths(batch, lengths) if "prompt_lengths" in batch else [0] * n
        for i in range(n):
            if lengths[i] > pls[i]:
                out[cu[i + 1] - 1] = scores[i]
        return out
    resp = batch.get("response_mask")
    if resp is None:
        raise ValueError("token-level rewards of a padded batch need its 'response_mask'")
    if scores.numel() != resp.shape[0]:
        raise ValueError(f"{scores.numel()} scores for {resp.shape[0]} rows")
    out = torch.zeros(resp.shape, dtype=torch.float32, device=resp.device)
    has, last = _last_true(resp)
    rows = torch.arange(resp.shape[0], device=resp.device)[has]
    out[rows, last[has]] = scores.to(resp.device)[has]
    return out


# ---- the role ------------------------------------------------------------------------------------
class RewardModel:
    """A frozen reward model with its own tokenizer; ``score(batch) -> float32 [N]`` on the CPU.

    Args:
        path: HF folder of a ``*ForSequenceClassification`` checkpoint (``num_labels=1``).
        tokenizer: the reward model's tokenizer (object or path); ``None``: the one in ``path``.
        actor_tokenizer: the tokenizer of the ids ``score`` receives; ``None``: they are already
            reward-model ids (fast path).
        dtype: parameter dtype (default: the checkpoint's).
        max_length: longest RM sequence (default: the smaller of the model's
            ``max_position_embeddings`` and the tokenizer's ``model_max_length``).
        truncation: ``"left"`` or ``"right"`` (see the module docstring).
        micro_batch_tokens: token budget of a packed microbatch.
        offload: ``"auto"`` | ``True`` | ``False`` (see the module docstring).
        same_tokenizer: force (``True``) or forbid (``False``) the fast path; ``None``: detect.
        tensor_parallel_size, pipeline_parallel_size: when given, must equal the current parallel
            state's (the reward model shares the actor's groups).
    """

    def __init__(self, path: str, tokenizer=None, actor_tokenizer=None, dtype=None,
                 max_length: int | None = None, truncation: str = "left",
                 micro_batch_tokens: int = 4096, offload: bool | str = "auto",
                 same_tokenizer: bool | None = None, tensor_parallel_size: int | None = None,
                 pipeline_parallel_size: int | None = None):
        import parallel_models as pm
        from parallel_models.config import load_hf_config
        from parallel_models.distributed import get_parallel_settings
        from parallel_models.llama.checkpoint_utils.loader import resolve_model_path

        if truncation not in TRUNCATION_POLICIES:
            raise ValueError(f"truncation must be one of {TRUNCATION_POLICIES}, got {truncation!r}")
        if not (isinstance(offload, bool) or offload == "auto"):
            raise ValueError(f"offload must be 'auto', True or False, got {offload!r}")
        if isinstance(micro_batch_tokens, bool) or not isinstance(micro_batch_tokens, int) \
                or micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be a positive int, got "
                             f"{micro_batch_tokens!r}")
        settings = get_parallel_settings()
        tp, pp = settings.tensor_parallel_size, settings.pipeline_parallel_size
        for name, want, have in (("tensor_parallel_size", tensor_parallel_size, tp),
                                 ("pipeline_parallel_size", pipeline_parallel_size, pp)):
            if want is not None and want != have:
                raise ConfigError(
                    f"reward.{name}={want} but the actor runs with {name}={have}: in this version "
                    f"the reward model shares the actor's model-parallel groups, so "
                    f"reward.{name} must equal the actor's ({have})")

        path = resolve_model_path(path)
        self.path = path
        arch = pm.registry.architecture_of(path)
        if not arch.endswith("ForSequenceClassification"):
            raise ConfigError(f"{path}: architecture {arch!r} is not a *ForSequenceClassification "
                              "checkpoint; a reward model needs its trained score head")
        hf_config = load_hf_config(path)
        num_labels = len(getattr(hf_config, "id2label", None) or {0: 0})
        if num_labels != 1:
            raise ConfigError(f"{path}: num_labels={num_labels}; a reward model has one output "
                              "(num_labels=1)")
        self.tokenizer = self._load_tokenizer(tokenizer, path)  # before the weights: fail fast
        self.pp = settings.pipeline_parallel_size
        cls = pm.get_model_class(arch, "value", rmpad=True, pp=self.pp > 1)
        if self.pp > 1:
            self.chunks = pm.build_pipeline_chunks(cls, path, dtype=dtype)
        else:
            self.chunks = [cls.from_pretrained(path, dtype=dtype)]
        for c in self.chunks:
            c.requires_grad_(False)
            c.eval()
        self.config = self.chunks[0].config

        self.actor_tokenizer = actor_tokenizer
        if same_tokenizer is None:
            same_tokenizer = actor_tokenizer is None or _same_tokenizer(actor_tokenizer,
                                                                        self.tokenizer)
        self.same_tokenizer = bool(same_tokenizer)
        if not self.same_tokenizer and actor_tokenizer is None:
            raise ValueError("same_tokenizer=False needs the actor_tokenizer to decode with")
        n_vocab = len(self.tokenizer) if self.tokenizer is not None else None
        if n_vocab is not None and n_vocab > self.config.vocab_size:
            raise ConfigError(f"the reward tokenizer has {n_vocab} tokens but the reward model "
                              f"{path} only {self.config.vocab_size} embeddings; wrong tokenizer?")

        if max_length is None:
            max_length = self.config.max_position_embeddings
            tok_max = getattr(self.tokenizer, "model_max_length", None)
            if isinstance(tok_max, int) and 0 < tok_max < 10**8:
                max_length = min(max_length, tok_max)
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.max_length = int(max_length)
        self.truncation = truncation
        self.micro_batch_tokens = micro_batch_tokens
        self.offload_mode = offload
        self.auto_offload = offload is True or (offload == "auto" and torch.cuda.is_available())
        self._offloader = Offloader(self.chunks)  # parallel_models.utils.offload
        self.metrics: dict[str, float] = {}
        self.num_truncated = 0  # over all calls
        if self.auto_offload:
            self.offload()

    # ---- construction helpers ----------------------------------------------------------------
    @classmethod
    def from_config(cls, reward_cfg, actor_tokenizer, **overrides) -> "RewardModel":
        """From the trainer's ``reward`` section (``parallel_models.rl.config.RewardSection``):
        ``model_path``, ``tokenizer``, ``tensor_parallel_size``, ``pipeline_parallel_size``
        (``None`` = the actor's; anything else must equal it), ``offload`` (``true`` means
        automatic offload where CUDA is present, like ``trainer.offload``); optional ``dtype``,
        ``max_length``, ``truncation``, ``micro_batch_tokens`` when the section has them.
        ``overrides`` win."""
        path = getattr(reward_cfg, "model_path", None)
        if not path:
            raise ConfigError("reward.type=model needs reward.model_path (an HF "
                              "*ForSequenceClassification folder)")
        offload = getattr(reward_cfg, "offload", "auto")
        kwargs: dict[str, Any] = dict(
            tokenizer=getattr(reward_cfg, "tokenizer", None), actor_tokenizer=actor_tokenizer,
            # the section's bool acts on CUDA only (as trainer.offload): True -> "auto"
            offload="auto" if offload is True else offload,
            tensor_parallel_size=getattr(reward_cfg, "tensor_parallel_size", None),
            pipeline_parallel_size=getattr(reward_cfg, "pipeline_parallel_size", None))
        for key in ("dtype", "max_length", "truncation", "micro_batch_tokens"):
            value = getattr(reward_cfg, key, None)
            if value is not None:
                kwargs[key] = value
        kwargs.update(overrides)
        return cls(path, **kwargs)

    @staticmethod
    def _load_tokenizer(tokenizer, path: str):
        if tokenizer is not None and not isinstance(tokenizer, str):
            return tokenizer
        from transformers import AutoTokenizer

        where = tokenizer or path
        try:
            return AutoTokenizer.from_pretrained(where)
        except Exception as err:
            raise ConfigError(f"cannot load the reward tokenizer from {where!r} "
                              f"({type(err).__name__}: {err}); set reward.tokenizer") from err

    # ---- re-tokenization ---------------------------------------------------------------------
    def encode_batch(self, batch: dict) -> tuple[list[list[int]], int]:
        """The reward model's token ids of every row (truncated) and how many were truncated."""
        if self.same_tokenizer:
            seqs = valid_sequences(batch)
        else:
            seqs = self._retokenize(batch)
        out, n_trunc = [], 0
        for i, ids in enumerate(seqs):
            if not ids:
                raise ValueError(f"row {i}: the conversation has no tokens at all (empty prompt "
                                 "and response, and the reward tokenizer adds none); nothing to "
                                 "score")
            if len(ids) > self.max_length:
                ids = self._truncate(ids)
                n_trunc += 1
            out.append(ids)
        return out, n_trunc

    def _truncate(self, ids: list[int]) -> list[int]:
        m = self.max_length
        if self.truncation == "right":
            return ids[:m]
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is not None and ids[0] == bos and m > 1:
            return [bos] + ids[len(ids) - (m - 1):]
        return ids[len(ids) - m:]

    def conversations(self, batch: dict) -> list[Any]:
        """What the reward tokenizer encodes per row: a chat (list of messages) when it has a
        chat template, else the concatenated text. Decodes with the actor tokenizer."""
        tok = self.actor_tokenizer
        if tok is None:
            raise ValueError("re-tokenization needs the actor_tokenizer")
        prompts, responses = split_prompt_response(batch)
        n = len(prompts)
        messages = batch.get("messages")
        if messages is not None and len(messages) != n:
            raise ValueError(f"batch['messages'] has {len(messages)} entries for {n} rows")
        messages = list(messages) if messages is not None else [None] * n
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
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

    def _retokenize(self, batch: dict) -> list[list[int]]:
        convs = self.conversations(batch)
        tok = self.tokenizer
        if convs and isinstance(convs[0], str):
            return [list(x) for x in tok(convs, add_special_tokens=True)["input_ids"]]
        texts = [tok.apply_chat_template(c, tokenize=False) for c in convs]
        return [list(x) for x in tok(texts, add_special_tokens=False)["input_ids"]]

    # ---- scoring -----------------------------------------------------------------------------
    def score(self, batch: dict) -> torch.Tensor:
        """Per-sequence scores ``float32 [N]`` on the CPU (every rank of the model-parallel group
        gets the same); updates ``metrics`` (``reward/truncated``: rows cut to ``max_length``)."""
        ids, n_trunc = self.encode_batch(batch)
        self.num_truncated += n_trunc
        self.metrics = {"reward/truncated": float(n_trunc),
                        "reward/rm_length_mean": sum(map(len, ids)) / max(len(ids), 1)}
        if n_trunc:
            logger.info("reward model: %d of %d sequences longer than max_length=%d were "
                        "%s-truncated", n_trunc, len(ids), self.max_length, self.truncation)
        return self.score_ids(ids)

    def score_ids(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Scores of reward-model token sequences (no truncation here)."""
        from parallel_models import pipeline
        from parallel_models.distributed import compute_device
        from parallel_models.utils.microbatch import plan_token_budget_partitions, restore_order
        from parallel_models.utils.padding import (cu_seqlens_from_lengths,
                                                   position_ids_from_cu_seqlens)

        if not ids:
            return torch.zeros(0, dtype=torch.float32)
        lengths = [len(s) for s in ids]
        if min(lengths) < 1:
            raise ValueError("cannot score an empty token sequence")
        top = max(max(s) for s in ids)
        if top >= self.config.vocab_size or min(min(s) for s in ids) < 0:
            raise ValueError(f"token id {top} is outside the reward model's vocabulary "
                             f"({self.config.vocab_size}); ids from another tokenizer?")
        budget = max(self.micro_batch_tokens, max(lengths))
        groups = plan_token_budget_partitions(lengths, budget)
        device = compute_device()
        mbs = []
        for g in groups:
            lens = torch.tensor([lengths[i] for i in g])
            cu = cu_seqlens_from_lengths(lens).to(device)
            flat = [t for i in g for t in ids[i]]
            mbs.append({"input_ids": torch.tensor(flat, dtype=torch.long, device=device),
                        "cu_seqlens": cu, "position_ids": position_ids_from_cu_seqlens(cu),
                        "max_seqlen": int(lens.max())})
        with self.on_device():
            outs = pipeline.forward_only(self.chunks, mbs, _last_token_scores)
        return restore_order([o.float().cpu() for o in outs], groups)

    def token_level_rewards(self, batch: dict, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Scores (computed when not given) placed on the actor response's last valid token;
        see :func:`place_scores`."""
        if scores is None:
            scores = self.score(batch)
        return place_scores(scores, batch)

    __call__ = score

    # ---- offload (one implementation for every role: parallel_models.utils.offload) --------
    @property
    def is_offloaded(self) -> bool:
        return self._offloader.is_offloaded

    def tensors(self) -> list[torch.Tensor]:
        """Every parameter and buffer tensor of the reward model (all chunks)."""
        return [slot.get() for slot in self._offloader.model_slots()]

    def offload(self) -> int:
        """Parameters and buffers to host memory (pinned on CUDA); returns the bytes moved off
        the compute device (0 when already offloaded)."""
        return self._offloader.offload()

    def onload(self) -> int:
        """Parameters and buffers back to the compute device; returns the bytes moved."""
        return self._offloader.onload()

    def on_device(self, with_optimizer: bool = False):
        """The weights on the compute device for the block; afterwards offloaded again when
        they were before or the mode is automatic (no optimizer: ``with_optimizer`` is for the
        role protocol)."""
        return self._offloader.on_device(offload_after=True if self.auto_offload else None)


_same_tokenizer = same_tokenizer


def _last_token_scores(out, mb) -> torch.Tensor:
    """The value at each packed sequence's last token."""
    return out.values[mb["cu_seqlens"][1:].long() - 1].float()
