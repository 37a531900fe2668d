"""``rollout.multi_turn``: a nested config section, set as ``rollout.multi_turn.KEY=value`` or
from YAML, off by default, with errors that name the key."""

import pytest

from parallel_models.errors import ConfigError
from parallel_models.rl.config import load_config


def test_multi_turn_is_off_by_default_and_set_by_dotted_overrides(tmp_path):
    cfg = load_config(None, [])
    assert not cfg.rollout.multi_turn.enabled and cfg.rollout.multi_turn.max_turns == 1
    cfg = load_config(None, ["rollout.multi_turn.max_turns=3", "rollout.multi_turn.tools="
                             "[calculator, python]", "rollout.multi_turn.max_total_tokens=64"])
    mt = cfg.rollout.multi_turn
    assert mt.enabled and (mt.max_turns, mt.tools, mt.max_total_tokens) == (
        3, ["calculator", "python"], 64)
    assert cfg.get("rollout.multi_turn.max_turns") == 3
    # YAML sets some fields; an override sets another; both stay
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("rollout:\n  multi_turn:\n    max_turns: 2\n    tool_timeout_s: 5\n")
    cfg = load_config(str(yaml_file), ["rollout.multi_turn.max_turn_tokens=7"])
    mt = cfg.rollout.multi_turn
    assert (mt.max_turns, mt.tool_timeout_s, mt.max_turn_tokens) == (2, 5.0, 7)


@pytest.mark.parametrize("override, message", [
    ("rollout.multi_turn.max_turn=3", "max_turn"),
    ("rollout.multi_turn.max_turns=0", "max_turns"),
    ("rollout.multi_turn.tools=[calculater]", "unknown tool 'calculater'"),
    ("rollout.multi_turn.tool_call_format=xml", "unknown tool call format 'xml'"),
    ("rollout.backend.x=1", "rollout.backend: expected a string"),
])
def test_bad_multi_turn_settings_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
