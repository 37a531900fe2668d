"""The PPO batch: :class:`RolloutBatch`, one row per sampled response.

It holds the rollout (``sequences``, ``attention_mask``, ``prompt_lengths``, ``response_mask``,
``group_index``) and what the later phases add (old / reference log-probs, values, scores,
token-level rewards, advantages, returns), plus non-tensor columns such as chat ``messages``.
It owns the operations on rows: selecting, concatenating (prompts left-padded, responses
right-padded to a common width) and cutting a PPO epoch into shuffled minibatches.

Layout: ``sequences [N, P+R]`` is the left-padded prompt followed by the right-padded
response; per-token tensors are ``[N, R]`` over the response positions; per-row tensors
``[N]``. Roles read it like a mapping (``batch["sequences"]``, ``batch.get("messages")``,
``"values" in batch``), so functions written for plain dicts keep working.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from parallel_models.utils import routes as route_utils

#: fields with one value per response token, ``[N, R]``
TOKEN_FIELDS = ("response_mask", "old_log_probs", "ref_log_probs", "values",
                "token_level_rewards", "advantages", "returns", "rollout_log_probs",
                "rollout_is_weights")
#: fields with one value per row, ``[N]``
ROW_FIELDS = ("prompt_lengths", "group_index", "scores")
#: fields over the whole sequence (prompt + response), ``[N, P+R]``
SEQUENCE_FIELDS = ("sequences", "attention_mask")
#: MoE routes ``[N, P+R, moe_layers, k]`` (compact dtype, ``parallel_models.utils.routes``)
ROUTE_FIELDS = ("routes",)

# who fills a field that a phase asks for before it exists (for the error message)
_PRODUCER = {"old_log_probs": "the actor (score phase)",
             "routes": "the rollout of an MoE actor (or R2's old-log-prob forward)",
             "rollout_log_probs": "the rollout", "ref_log_probs": "the reference policy",
             "values": "the critic (only when needs_critic(cfg): the estimator needs one)",
             "scores": "the reward (score phase)", "advantages": "the advantage phase",
             "returns": "the advantage phase", "token_level_rewards": "the advantage phase"}


@dataclasses.dataclass
class RolloutBatch:
    sequences: torch.Tensor
    attention_mask: torch.Tensor
    prompt_lengths: torch.Tensor
    response_mask: torch.Tensor
    group_index: torch.Tensor
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    token_level_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None  # the sampler's log-probs (in-process engine)
    rollout_is_weights: torch.Tensor | None = None  # rollout correction (algorithms/rollout_correction.py)
    routes: torch.Tensor | None = None  # MoE: experts each token was routed to
    columns: dict[str, list] = dataclasses.field(default_factory=dict)  # e.g. "messages"

    def __post_init__(self) -> None:
        n, width = self.sequences.shape[0], self.sequences.shape[1]
        r = self.response_mask.shape[1]
        for name, value in self.tensor_items():
            if value.shape[0] != n:
                raise ValueError(f"RolloutBatch.{name} has {value.shape[0]} rows, sequences {n}")
            if name in TOKEN_FIELDS and tuple(value.shape) != (n, r):
                raise ValueError(f"RolloutBatch.{name} has shape {tuple(value.shape)}, expected "
                                 f"{(n, r)} (rows, response length)")
            if name in SEQUENCE_FIELDS and tuple(value.shape) != (n, width):
                raise ValueError(f"RolloutBatch.{name} has shape {tuple(value.shape)}, expected "
                                 f"{(n, width)}")
            if name in ROUTE_FIELDS and (value.dim() != 4 or tuple(value.shape[:2]) != (n, width)):
                raise ValueError(f"RolloutBatch.{name} has shape {tuple(value.shape)}, expected "
                                 f"{(n, width)} + (moe_layers, k)")
            if name in ROW_FIELDS and value.dim() != 1:
                raise ValueError(f"RolloutBatch.{name} must be 1-D [rows], got "
                                 f"{tuple(value.shape)}")
        if r > width:
            raise ValueError(f"response length {r} exceeds the sequence width {width}")
        for key, col in self.columns.items():
            if len(col) != n:
                raise ValueError(f"RolloutBatch column {key!r} has {len(col)} entries for {n} rows")

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> "RolloutBatch":
        """From a dict of the field names (tensors) plus list columns; unknown tensors raise."""
        names = {f.name for f in dataclasses.fields(cls)} - {"columns"}
        tensors = {k: v for k, v in data.items() if k in names}
        columns = {k: v for k, v in data.items() if k not in names}
        bad = [k for k, v in columns.items() if torch.is_tensor(v)]
        if bad:
            raise ValueError(f"RolloutBatch has no tensor field {bad[0]!r}; fields: "
                             f"{', '.join(sorted(names))}")
        if "group_index" not in tensors:
            tensors["group_index"] = torch.arange(data["sequences"].shape[0])
        return cls(**tensors, columns={k: list(v) for k, v in columns.items()})

    # ---- mapping view (roles and reward functions read batches like dicts) ---------------------
    def tensor_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if torch.is_tensor(value):
                yield f.name, value

    def keys(self) -> list[str]:
        return [k for k, _ in self.tensor_items()] + list(self.columns)

    def items(self) -> list[tuple[str, Any]]:
        return list(self.tensor_items()) + list(self.columns.items())

    def __contains__(self, key: str) -> bool:
        return key in self.keys()

    def __getitem__(self, key: str):
        if key in self.columns:
            return self.columns[key]
        value = getattr(self, key, None) if key in self._field_names() else None
        if not torch.is_tensor(value):
            who = _PRODUCER.get(key)
            raise KeyError(f"the batch has no {key!r}" + (f" yet (filled by {who})" if who else "")
                           + f"; present: {', '.join(self.keys())}")
        return value

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def __setitem__(self, key: str, value) -> None:
        if key in self._field_names():
            setattr(self, key, value)
        else:
            self.columns[key] = list(value)
        self.__post_init__()

    @classmethod
    def _field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - {"columns"}

    def __len__(self) -> int:
        return self.sequences.shape[0]

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    # ---- rows ----------------------------------------------------------------------------------
    def select(self, rows: torch.Tensor | list[int]) -> "RolloutBatch":
        """The given rows (in that order), every field and column."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        fields = {k: v[idx.to(v.device)] for k, v in self.tensor_items()}
        cols = {k: [c[i] for i in idx.tolist()] for k, c in self.columns.items()}
        return RolloutBatch(**fields, columns=cols)

    def to(self, device) -> "RolloutBatch":
        return RolloutBatch(**{k: v.to(device) for k, v in self.tensor_items()},
                            columns=dict(self.columns))

    def minibatches(self, mini_batch_size: int, data_parallel_size: int, seed: int
                    ) -> list["RolloutBatch"]:
        """One PPO epoch's shuffled minibatches of this rank's rows.

        ``mini_batch_size`` counts rows over all data-parallel ranks; each rank takes
        ``mini_batch_size // data_parallel_size`` of its own rows per minibatch (every rank uses
        the same ``seed``, so all ranks make the same number of optimizer steps). A global
        minibatch is thus stratified over the ranks: with one minibatch per epoch DP=N trains
        exactly like DP=1 on the same rows; with several, the minibatches hold other (equally
        random) row sets than DP=1's shuffle would.
        """
        if mini_batch_size < data_parallel_size or mini_batch_size % data_parallel_size:
            raise ValueError(f"actor.mini_batch_size ({mini_batch_size}) must be a positive "
                             f"multiple of the data-parallel size ({data_parallel_size})")
        per_rank = mini_batch_size // data_parallel_size
        order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        return [self.select(order[i:i + per_rank]) for i in range(0, len(self), per_rank)]

    def data_parallel_share(self, rank: int, size: int) -> "RolloutBatch":
        """Rank ``rank``'s rows when the batch's groups (prompts) are dealt round-robin over
        ``size`` ranks, in the order they first appear: a group never straddles ranks, which
        the group baselines of grpo / rloo need. The trainer deals prompts the same way before
        the rollout."""
        _, first = torch.unique(self.group_index, return_inverse=True)
        order = {}
        for g in first.tolist():
            order.setdefault(g, len(order))
        rows = [i for i, g in enumerate(first.tolist()) if order[g] % size == rank]
        return self.select(rows)

    @classmethod
    def concat(cls, batches: list["RolloutBatch"]) -> "RolloutBatch":
        """Rows of all ``batches`` in order. Prompts are left-padded and responses right-padded
        to the widest; ``group_index`` is offset per batch so groups of different batches stay
        apart. Fields present in some batches only raise."""
        if not batches:
            raise ValueError("RolloutBatch.concat needs at least one batch")
        keys = [k for k, _ in batches[0].tensor_items()]
        for b in batches[1:]:
            if [k for k, _ in b.tensor_items()] != keys or b.columns.keys() != \
                    batches[0].columns.keys():
                raise ValueError(f"RolloutBatch.concat: batches hold different fields "
                                 f"({batches[0].keys()} vs {b.keys()})")
        resp = max(b.response_length for b in batches)
        prompt = max(b.sequences.shape[1] - b.response_length for b in batches)
        out: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        offset = 0
        for b in batches:
            dr, dp = resp - b.response_length, prompt - (b.sequences.shape[1] - b.response_length)
            for k, v in b.tensor_items():
                if k in SEQUENCE_FIELDS:
                    v = F.pad(v, (dp, dr))
                elif k in ROUTE_FIELDS:
                    v = route_utils.pad_sequence_axis(v, dp, dr)
                elif k in TOKEN_FIELDS:
                    v = F.pad(v, (0, dr))
                elif k == "group_index":
                    v = v + offset
                out[k].append(v)
            if len(b):
                offset += int(b.group_index.max()) + 1
        cols = {k: [x for b in batches for x in b.columns[k]] for k in batches[0].columns}
        return cls(**{k: torch.cat(v) for k, v in out.items()}, columns=cols)
