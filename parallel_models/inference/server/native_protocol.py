"""The native API's request bodies (``/generate``, ``/update_weights``; ``app.py`` serves them).

``/generate``'s ``prompt_seeds`` (one per prompt, in [0, 2^62)) seed each prompt's samples on
their own: sample j draws with the counter-based noise of ``row_sampling.row_seed(seed, j)``,
whatever else the server batches, in the static and the continuous batcher alike, and the same
tokens as the in-process rollout engine given the same seeds (the PPO trainer's
``row_sampling.prompt_seed``: a run's samples do not depend on where they are generated).
"""

from __future__ import annotations

from typing import Annotated, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      model_validator)

from parallel_models.inference.sampling import Number, SamplingParams
from parallel_models.inference.server.openai_protocol import SEED_LIMIT

MAX_TEMPERATURE = 100.0  # above it any logits give near-uniform draws: a mistake, not a setting


class GenerateRequest(SamplingParams):
    """The /generate body: prompts, whether to decode text, and the sampling params."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[Union[StrictStr, list[StrictInt]]] = Field(min_length=1)
    temperature: Number = Field(1.0, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    seed: Optional[StrictInt] = Field(None, ge=0, lt=SEED_LIMIT, description="seed of the draws "
                                      "(distinct seeds give distinct draws); null = the global "
                                      "generator")
    return_text: StrictBool = True
    return_routes: StrictBool = False  # MoE: per token and MoE layer the top-k experts used
    prompt_seeds: Optional[list[Annotated[StrictInt, Field(ge=0, lt=SEED_LIMIT)]]] = Field(
        None, description="per prompt, the seed of its samples' draws (sample j draws with the "
                          "noise of row_sampling.row_seed(seed, j)); null = ``seed``")

    prompt_max_new_tokens: Optional[list[Annotated[StrictInt, Field(ge=1)]]] = Field(
        None, description="per prompt, the most new tokens of its samples (each <= "
                          "max_new_tokens); null = max_new_tokens for every prompt")

    @model_validator(mode="after")
    def _one_seed_per_prompt(self):
        if self.prompt_seeds is not None and len(self.prompt_seeds) != len(self.prompts):
            raise ValueError(f"prompt_seeds: {len(self.prompt_seeds)} seeds for "
                             f"{len(self.prompts)} prompts")
        caps = self.prompt_max_new_tokens
        if caps is not None and len(caps) != len(self.prompts):
            raise ValueError(f"prompt_max_new_tokens: {len(caps)} caps for "
                             f"{len(self.prompts)} prompts")
        if caps is not None and max(caps) > self.max_new_tokens:
            raise ValueError(f"prompt_max_new_tokens: {max(caps)} is over max_new_tokens "
                             f"{self.max_new_tokens}")
        return self

    def sampling(self) -> SamplingParams:
        return SamplingParams.model_validate(self.model_dump(
            exclude={"prompts", "return_text", "return_routes", "prompt_seeds",
                     "prompt_max_new_tokens"}))


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: StrictStr = Field(min_length=1)


__all__ = ["GenerateRequest", "MAX_TEMPERATURE", "UpdateWeightsRequest"]
