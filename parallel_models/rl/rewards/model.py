"""Reward model role: a frozen Value RmPad model (any TP/PP) loaded from an HF
``*ForSequenceClassification`` checkpoint, with its own tokenizer, offloaded to host memory between
calls.

Input
    The PPO batch of the actor (see ``parallel_models.rl.roles.model_roles``), padded in any layout or packed
    (``parallel_models.rl.rewards.inputs``); optionally ``messages``: one structured chat prompt
    (list of ``{"role", "content"}``) or ``None`` per row.

Tokenizers (``parallel_models.rl.rewards.tokenizer``)
    The reward model has its own tokenizer (the one saved in its folder, loaded as saved, or
    ``tokenizer=``). When it differs from the actor's, every row is decoded with the actor's
    tokenizer and re-encoded with the reward model's (its chat template when it has one), then
    truncated to ``max_length`` (``truncation="left"`` keeps the end, where the score is read);
    truncated rows are counted in ``metrics["reward/truncated"]``. Same tokenizer (detected, or
    ``same_tokenizer=True``): the actor's valid token ids are scored as they are, without decoding
    (fast path); the reward-model folder then needs no tokenizer files.

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
    is a ``ConfigError`` (a separate RM process group is future work). ``layers_per_stage`` splits
    the layers unevenly over the pipeline stages (one count per virtual stage), for a layer count
    that PP does not divide.

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
from parallel_models.rl.rewards.inputs import place_scores, valid_sequences
from parallel_models.rl.rewards.tokenizer import (TRUNCATION_POLICIES, conversations,
                                                 resolve_reward_tokenizer, retokenize, truncate)
from parallel_models.utils.offload import Offloader

logger = logging.getLogger(__name__)

__all__ = ["RewardModel"]


# ---- the role ------------------------------------------------------------------------------------
class RewardModel:
    """A frozen reward model with its own tokenizer; ``score(batch) -> float32 [N]`` on the CPU.

    Args:
        path: HF folder of a ``*ForSequenceClassification`` checkpoint (``num_labels=1``).
        tokenizer: the reward model's tokenizer (object or path); ``None``: the one saved in
            ``path`` (loaded as saved, see ``parallel_models.tokenizer.load_tokenizer``; on the
            fast path ``path`` may hold no tokenizer files).
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
        layers_per_stage: layers per (virtual) pipeline stage, for an uneven split (see
            ``parallel_models.pipeline.pipeline_layout``); ``None``: an even split.
    """

    def __init__(self, path: str, tokenizer=None, actor_tokenizer=None, dtype=None,
                 max_length: int | None = None, truncation: str = "left",
                 micro_batch_tokens: int = 4096, offload: bool | str = "auto",
                 same_tokenizer: bool | None = None, tensor_parallel_size: int | None = None,
                 pipeline_parallel_size: int | None = None,
                 layers_per_stage: Sequence[int] | None = None):
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
        # before the weights: fail fast
        self.tokenizer, self.same_tokenizer = resolve_reward_tokenizer(
            tokenizer, path, actor_tokenizer, same_tokenizer)
        self.actor_tokenizer = actor_tokenizer
        self.pp = settings.pipeline_parallel_size
        self.layers_per_stage = self._check_layers_per_stage(layers_per_stage, hf_config, settings)
        self.chunks, self.config = self._build_model(path, arch, dtype)

        n_vocab = len(self.tokenizer) if self.tokenizer is not None else None
        if n_vocab is not None and n_vocab > self.config.vocab_size:
            whose = "actor's (standing in on the fast path)" \
                if self.tokenizer is actor_tokenizer else "reward"
            raise ConfigError(f"the {whose} tokenizer has {n_vocab} tokens but the reward model "
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
        self._offloader = self._make_offloader()
        self.metrics: dict[str, float] = {}
        self.num_truncated = 0  # over all calls
        if self.auto_offload:
            self.offload()

    # ---- construction helpers ----------------------------------------------------------------
    def _build_model(self, path: str, arch: str, dtype) -> tuple[list, Any]:
        """This rank's frozen model chunks and their config (vocab_size,
        max_position_embeddings); the fsdp backend's reward model overrides it."""
        import parallel_models as pm

        cls = pm.get_model_class(arch, "value", rmpad=True, pp=self.pp > 1)
        if self.pp > 1:
            chunks = pm.build_pipeline_chunks(cls, path, dtype=dtype,
                                              layers_per_stage=self.layers_per_stage)
        else:
            chunks = [cls.from_pretrained(path, dtype=dtype)]
        for c in chunks:
            c.requires_grad_(False)
            c.eval()
        return chunks, chunks[0].config

    def _make_offloader(self):
        return Offloader(self.chunks)  # parallel_models.utils.offload

    def _forward_scores(self, mbs: list[dict]) -> list[torch.Tensor]:
        """The score of every packed sequence of each microbatch (its last token's value)."""
        from parallel_models import pipeline

        return pipeline.forward_only(self.chunks, mbs, _last_token_scores)

    @classmethod
    def from_config(cls, reward_cfg, actor_tokenizer, **overrides) -> "RewardModel":
        """From the trainer's ``reward`` section (``parallel_models.rl.config.RewardSection``):
        ``model_path``, ``tokenizer``, ``tensor_parallel_size``, ``pipeline_parallel_size``
        (``None`` = the actor's; anything else must equal it), ``offload`` (``true`` means
        automatic offload where CUDA is present, like ``trainer.offload``); optional ``dtype``,
        ``max_length``, ``truncation``, ``micro_batch_tokens``, ``layers_per_stage``,
        ``same_tokenizer`` when the section has them.
        ``overrides`` win."""
        path = getattr(reward_cfg, "model_path", None)
        if not path:
            raise ConfigError("reward.type=model needs reward.model_path (an HF "
                              "*ForSequenceClassification folder)")
        offload = getattr(reward_cfg, "offload", "auto")
        kwargs: dict[str, Any] = dict(
            tokenizer=getattr(reward_cfg, "tokenizer", None), actor_tokenizer=actor_tokenizer,
            same_tokenizer=getattr(reward_cfg, "same_tokenizer", None),
            # the section's bool acts on CUDA only (as trainer.offload): True -> "auto"
            offload="auto" if offload is True else offload,
            tensor_parallel_size=getattr(reward_cfg, "tensor_parallel_size", None),
            pipeline_parallel_size=getattr(reward_cfg, "pipeline_parallel_size", None))
        for key in ("dtype", "max_length", "truncation", "micro_batch_tokens", "layers_per_stage"):
            value = getattr(reward_cfg, key, None)
            if value is not None:
                kwargs[key] = value
        kwargs.update(overrides)
        return cls(path, **kwargs)

    def _check_layers_per_stage(self, layers_per_stage, hf_config, settings) -> list[int] | None:
        """``layers_per_stage`` as a list, checked against the layer count and the pipeline
        layout (a ``ConfigError`` naming the counts before any weight is read)."""
        from parallel_models.pipeline import pipeline_layout

        if layers_per_stage is None:
            return None
        if not isinstance(layers_per_stage, (list, tuple)) or not all(
                isinstance(n, int) and not isinstance(n, bool) for n in layers_per_stage):
            raise ConfigError(f"reward layers_per_stage must be a list of ints, got "
                              f"{layers_per_stage!r}")
        counts = list(layers_per_stage)
        # raises a ConfigError naming the counts when they do not fit
        pipeline_layout(hf_config.num_hidden_layers, settings.pipeline_parallel_size,
                        settings.virtual_pipeline_parallel_size, counts)
        return counts

    # ---- re-tokenization (parallel_models.rl.rewards.tokenizer) -------------------------------
    def encode_batch(self, batch: dict) -> tuple[list[list[int]], int]:
        """The reward model's token ids of every row (truncated) and how many were truncated."""
        if self.same_tokenizer:
            seqs = valid_sequences(batch)
        else:
            seqs = retokenize(batch, self.actor_tokenizer, self.tokenizer)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        out, n_trunc = [], 0
        for i, ids in enumerate(seqs):
            if not ids:
                raise ValueError(f"row {i}: the conversation has no tokens at all (empty prompt "
                                 "and response, and the reward tokenizer adds none); nothing to "
                                 "score")
            if len(ids) > self.max_length:
                ids = truncate(ids, self.max_length, self.truncation, bos)
                n_trunc += 1
            out.append(ids)
        return out, n_trunc

    def conversations(self, batch: dict) -> list[Any]:
        """What the reward tokenizer encodes per row (see
        ``parallel_models.rl.rewards.tokenizer.conversations``)."""
        return conversations(batch, self.actor_tokenizer, self.tokenizer)

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
            outs = self._forward_scores(mbs)
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


def _last_token_scores(out, mb) -> torch.Tensor:
    """The value at each packed sequence's last token."""
    return out.values[mb["cu_seqlens"][1:].long() - 1].float()
