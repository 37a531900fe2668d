"""PPO configuration: pydantic v2 sections, loaded from YAML, overridden with ``key=value``.

    cfg = load_config("ppo.yaml", ["actor.lr=1e-5", "trainer.total_steps=20"])
    cfg = load_config(None, [])            # the built-in default run (tiny Llama, CPU)

- ``sections.py``: one model per section (bounds, a description per field; ``rollout`` shares
  the fields of ``SamplingParams``, ``actor`` / ``critic`` those of ``OptimConfig``);
- ``checks.py``: the cross-field checks (layout vs world size and heads, batch divisibility,
  files that must exist, options that need one another);
- ``ppo.py``: ``PPOConfig``, YAML loading and dotted overrides, save / reload;
- ``errors.py``: messages that name the key, the source, the expected type or range;
- ``render.py``: ``configs/default.yaml`` rendered from the models (``python -m
  parallel_models.rl.config.render`` rewrites it; a test checks the packaged file).
"""

from parallel_models.errors import ConfigError
from parallel_models.options import KernelOptions  # the `kernels` section
from parallel_models.rl.config.ppo import (PPOConfig, default_config_path, load_config,
                                           parse_override)
from parallel_models.rl.config.sections import (DATA_SUFFIXES, SECTION_DEFAULTS,
                                                SECTIONS, ActorSection, AlgorithmSection,
                                                CriticSection, DataSection, LossAggMode,
                                                ModelSection, ParallelSection, RewardSection,
                                                RolloutSection, TrainerSection)

__all__ = ["PPOConfig", "SECTIONS", "SECTION_DEFAULTS", "ConfigError", "load_config",
           "parse_override", "default_config_path", "LossAggMode",
           "DATA_SUFFIXES"] + [k.__name__ for k in SECTIONS.values()]
