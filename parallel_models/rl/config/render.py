"""``configs/default.yaml`` rendered from the config models: every section and key with its
default and the field's description as a comment. The packaged file is this rendering (a test
checks it); after changing a field, regenerate it with

    python -m parallel_models.rl.config.render            # rewrites the packaged file
    python -m parallel_models.rl.config.render OUT.yaml   # or writes elsewhere ("-": stdout)
"""

from __future__ import annotations

import sys

import yaml
from pydantic import BaseModel

from parallel_models.rl.config.ppo import PPOConfig, default_config_path

HEADER = """\
# The built-in default PPO run: a tiny Llama and a character tokenizer built on the spot, the
# built-in prompts and a rule-based reward (share of vowels) that PPO raises within ~20 steps on
# 2 CPU cores. Generated from parallel_models/rl/config/sections.py by
# `python -m parallel_models.rl.config.render` (do not edit by hand); copy it to start a config
# of your own, then run:
#   parallel-models-ppo --config my.yaml [section.key=value ...]
"""
COMMENT_COLUMN = 28


def _scalar(value) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _line(text: str, desc: str | None) -> str:
    return text.ljust(COMMENT_COLUMN - 2) + f"  # {desc}" if desc else text


def render_default_yaml(config: PPOConfig | None = None) -> str:
    """The commented YAML of ``config`` (default: the built-in defaults)."""
    config = config or PPOConfig()
    data = config.to_dict()
    lines = [HEADER]
    for section, field in type(config).model_fields.items():
        lines.append(f"{section}:" + (f"  # {field.description}" if field.description else ""))
        section_model = type(getattr(config, section))
        for key, value in data[section].items():
            desc = section_model.model_fields[key].description
            group_model = type(getattr(getattr(config, section), key))
            if issubclass(group_model, BaseModel):  # a nested group (actor.lora): one level in
                lines.append(f"  {key}:" + (f"  # {desc}" if desc else ""))
                for sub, sub_value in value.items():
                    lines.append(_line(f"    {sub}: {_scalar(sub_value)}",
                                       group_model.model_fields[sub].description))
                continue
            lines.append(_line(f"  {key}: {_scalar(value)}", desc))
        lines.append("")
    return "\n".join(lines[:-1]) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = argv[0] if argv else default_config_path()
    text = render_default_yaml()
    if out == "-":
        sys.stdout.write(text)
    else:
        with open(out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
