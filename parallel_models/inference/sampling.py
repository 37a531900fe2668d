"""Sampling parameters: the one definition used by the PPO config (``rollout`` section), the
generation engine, the rollout server's ``/generate`` request and its client.

A pydantic v2 model with ``extra="forbid"`` and bounds, so a bad value fails where it enters
(config file, command-line override, HTTP body, Python call) with the field's name:

- ``temperature >= 0``, and ``> 0`` unless ``greedy`` (greedy decoding ignores it);
- ``top_k >= 0`` (0 = off), ``0 < top_p <= 1`` (1 = off), ``max_new_tokens >= 1``, ``n >= 1``;
- ``stop_token_ids``: token ids >= 0 that end a sample besides the EOS token(s);
- ``eos_token_id``: ``None`` = the serving side's tokenizer EOS (the rollout engine fills it in);
  ``ignore_eos`` drops it, so only ``stop_token_ids`` and ``max_new_tokens`` end a sample;
- ``seed``: reproducible draws (its own generator) where set.

Integers and booleans are strict (``"2"`` is not an ``n``); floats accept integers and numeric
strings (YAML 1.1 reads ``1e-5`` as a string) but not booleans.
"""

from __future__ import annotations

from typing import Annotated, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt,
                      ValidationInfo, field_validator)


def _not_bool(value):
    if isinstance(value, bool):
        raise ValueError("expected a number, not true/false")
    return value


Number = Annotated[float, BeforeValidator(_not_bool)]
TokenId = Annotated[StrictInt, Field(ge=0)]


class SamplingFields(BaseModel):
    """The sampling knobs shared by :class:`SamplingParams` and the PPO config's ``rollout``
    section (which leaves out ``seed``: the trainer seeds each step's draws)."""

    model_config = ConfigDict(extra="forbid")

    n: StrictInt = Field(1, ge=1, description="samples per prompt")
    max_new_tokens: StrictInt = Field(16, ge=1, description="tokens generated at most per sample")
    greedy: StrictBool = Field(False, description="argmax decoding (temperature, top_k, top_p "
                                                  "unused)")
    temperature: Number = Field(1.0, ge=0, description="softmax temperature; > 0 unless greedy")
    top_k: StrictInt = Field(0, ge=0, description="keep the k most likely tokens; 0 = off")
    top_p: Number = Field(1.0, gt=0, le=1, description="nucleus sampling mass; 1.0 = off")
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64,
                                          description="token ids that end a sample, besides EOS")
    eos_token_id: Optional[Union[TokenId, list[TokenId]]] = Field(
        None, description="EOS id(s); null = the tokenizer's")
    ignore_eos: StrictBool = Field(False, description="do not stop at EOS (only at "
                                                      "stop_token_ids or max_new_tokens)")

    @field_validator("temperature")
    @classmethod
    def _temperature_positive_unless_greedy(cls, value: float, info: ValidationInfo) -> float:
        if value == 0 and not info.data.get("greedy", False):
            raise ValueError("temperature must be > 0 (or greedy=true)")
        return value


class SamplingParams(SamplingFields):
    """How to draw the continuations of a prompt."""

    seed: Optional[StrictInt] = Field(None, description="seed of the draws; null = the global "
                                                        "generator")

    def validate(self) -> "SamplingParams":  # noqa: D102 - re-check values assigned in code
        """Re-validate the current values (fields may have been assigned after construction);
        raises ``ValueError`` (pydantic's ``ValidationError``) naming the field."""
        type(self).model_validate(self.model_dump(warnings=False))
        return self

    def stop_ids(self, default_eos: int | list[int] | None = None) -> list[int]:
        """Token ids that end a sample: EOS (``eos_token_id``, else ``default_eos``; none with
        ``ignore_eos``) then ``stop_token_ids``."""
        eos = self.eos_token_id if self.eos_token_id is not None else default_eos
        if self.ignore_eos or eos is None:
            eos = []
        elif isinstance(eos, int):
            eos = [eos]
        return list(eos) + [t for t in self.stop_token_ids if t not in eos]

    def sampling_key(self) -> tuple:
        """Rows whose params have the same key (everything but ``n`` and ``seed``) can share one
        generate call."""
        data = self.model_dump(exclude={"n", "seed"})
        return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(data.items()))


__all__ = ["SamplingParams", "SamplingFields", "Number", "TokenId"]
