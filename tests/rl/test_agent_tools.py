"""The agentic tool layer: the Hermes tool-call parser, argument checks, the calculator, the
python sandbox's limits, the executor's error handling and the loading of tools and
environments from users' files."""

import dataclasses
import json
import time

import pytest

from parallel_models.errors import ConfigError
from parallel_models.rl.agents.calculator import CalculatorError, calculator, evaluate
from parallel_models.rl.agents.environment import load_environment, step_result
from parallel_models.rl.agents.executor import ToolExecutor, tool_messages, tool_metrics
from parallel_models.rl.agents.python_sandbox import SandboxLimits, ToolError, run_python
from parallel_models.rl.agents.schema import Tool, argument_errors
from parallel_models.rl.agents.tool_call_format import parse_tool_calls
from parallel_models.rl.agents.tools import resolve_tools


def _call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + \
        "\n</tool_call>"


def test_hermes_parser_good_and_bad_calls():
    text = ("I will compute. " + _call("calculator", expression="2+3") + " and "
            + _call("python", code="print(1)"))
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2+3"}, None), ("python", {"code": "print(1)"}, None)]
    assert parse_tool_calls("no calls here") == []
    # arguments as a JSON string (some models write them so)
    (c,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert (c.name, c.arguments, c.error) == ("f", {"x": 1}, None)
    bad = parse_tool_calls("<tool_call>{not json}</tool_call>"
                           "<tool_call>[1, 2]</tool_call>"
                           '<tool_call>{"arguments": {}}</tool_call>'
                           '<tool_call>{"name": "f", "arguments": 3}</tool_call>'
                           '<tool_call>{"name": "f"')
    assert len(bad) == 5 and all(c.error for c in bad)
    assert "not valid JSON" in bad[0].error and "JSON object" in bad[1].error
    assert "name" in bad[2].error and "arguments" in bad[3].error
    assert "unterminated" in bad[4].error


def test_unknown_call_format_is_a_config_error():
    with pytest.raises(ConfigError, match="tool call format 'hermez'.*did you mean 'hermes'"):
        parse_tool_calls("x", "hermez")


def test_argument_errors():
    schema = {"type": "object", "properties": {"x": {"type": "integer"},
                                               "mode": {"type": "string", "enum": ["a", "b"]},
                                               "xs": {"type": "array",
                                                      "items": {"type": "number"}}},
              "required": ["x"], "additionalProperties": False}
    assert argument_errors(schema, {"x": 1, "mode": "a", "xs": [1, 2.5]}) == []
    errors = argument_errors(schema, {"x": True, "mode": "c", "xs": [1, "2"], "y": 0})
    assert len(errors) == 4, errors
    assert any("arguments.x: expected integer, got boolean" in e for e in errors)
    assert any("'c' is not one of" in e for e in errors)
    assert any("arguments.xs[1]: expected number" in e for e in errors)
    assert any("unexpected argument 'y'" in e for e in errors)
    assert argument_errors(schema, {}) == ["arguments: missing required argument 'x'"]


def test_calculator_matches_python_arithmetic_and_refuses_the_rest():
    for expression in ["2 + 3 * 4", "(12 + 7) * 3 - 5 / 2", "2 ** 10 // 3 % 7", "-3.5 * -2",
                       "abs(-4) + max(1, 9) - min(3, 2) + round(2.6)"]:
        assert evaluate(expression) == eval(expression)  # the oracle: Python itself
    assert calculator("10 / 4") == "2.5" and calculator("6 / 3") == "2"
    for bad, why in [("__import__('os')", "not allowed"), ("x + 1", "not allowed"),
                     ("'a' * 3", "not allowed"), ("1 / 0", "ZeroDivisionError"),
                     ("9 ** 9 ** 9", "too large"), ("2 +", "not an arithmetic"), ("", "empty"),
                     ("(1).__class__", "not allowed")]:
        with pytest.raises(CalculatorError, match=why):
            evaluate(bad)


LIMITS = SandboxLimits(cpu_seconds=1, memory_mb=256, max_output_bytes=1 << 20,
                       wall_seconds=8.0, max_result_chars=200)
# the wall-clock breach (a sleep) waits out its limit: a short one, with the same 4 s of slack
SHORT_WALL = dataclasses.replace(LIMITS, wall_seconds=1.5)

pytestmark = pytest.mark.timed  # its limits hold with the background stopped: background_lane.py


def test_python_sandbox_runs_code_in_an_empty_environment_and_removes_its_folder():
    out = run_python("import os, sys\nprint(6 * 7)\nprint(dict(os.environ))\n"
                     "print(os.getcwd())\nprint(sys.flags.isolated, sys.flags.no_site)",
                     LIMITS)
    answer, environ, folder, flags = out.strip().split("\n")
    assert answer == "42" and flags == "1 1"
    assert set(eval(environ)) <= {"LC_CTYPE"}  # nothing inherited (the interpreter's locale)
    import os
    assert "pm_python_tool_" in folder and not os.path.exists(folder)


@pytest.mark.parametrize("code, why, limits, within_s", [
    ("while True: pass", "CPU-time limit", LIMITS, 8.0),
    ("x = bytearray(10 * 2**30)", "out of memory", LIMITS, 8.0),
    ("import sys\nchunk = 'x' * 1000000\nfor _ in range(100): sys.stdout.write(chunk)",
     "output limit", LIMITS, 8.0),
    ("import time\ntime.sleep(60)", "wall-clock", SHORT_WALL, SHORT_WALL.wall_seconds + 4.0),
    ("raise ValueError('boom')", "exited with status 1", LIMITS, 8.0),
], ids=["cpu", "memory", "output", "wall", "status"])
def test_python_sandbox_stops_each_limit_breach_as_a_tool_error(code, why, limits, within_s):
    start = time.monotonic()
    with pytest.raises(ToolError, match=why) as err:
        run_python(code, limits)
    assert time.monotonic() - start < within_s
    assert len(str(err.value)) < 1000  # the output handed back is capped


def test_executor_turns_every_bad_call_into_a_counted_tool_error():
    def slow(seconds: float) -> str:
        time.sleep(seconds)
        return "late"

    def crash() -> str:
        raise RuntimeError("tool crashed")

    tools = resolve_tools(["calculator"])
    tools["slow"] = Tool("slow", "sleeps", {"type": "object", "properties": {
        "seconds": {"type": "number"}}, "required": ["seconds"]}, slow)
    tools["crash"] = Tool("crash", "raises", {"type": "object", "properties": {}}, crash)
    executor = ToolExecutor(tools, timeout_s=0.5)
    try:
        turn = (_call("calculator", expression="(2 + 3) * 4") + "<tool_call>{oops</tool_call>"
                + _call("search", query="x") + _call("calculator", expr="1")
                + _call("slow", seconds=3) + _call("crash"))
        start = time.monotonic()
        records = executor.submit(turn).result()
        assert time.monotonic() - start < 2.5  # the slow call is answered at its timeout
    finally:
        executor.close()
    assert [r.error for r in records] == [False, True, True, True, True, True]
    assert records[0].result == "20"
    assert "not valid JSON" in records[1].result
    assert "unknown tool 'search'" in records[2].result and "calculator" in records[2].result
    assert "missing required argument 'expression'" in records[3].result
    assert "unexpected argument 'expr'" in records[3].result
    assert "did not finish within 0.5 s" in records[4].result
    assert "tool crashed" in records[5].result
    assert tool_messages(records[:1]) == [{"role": "tool", "name": "calculator",
                                           "content": "20"}]
    metrics = tool_metrics(records)
    assert metrics["calls"] == 6 and metrics["errors"] == 5 and metrics["seconds"] > 0.4


def test_executor_reports_the_python_sandbox_limits_as_tool_errors():
    from parallel_models.rl.agents.python_sandbox import python_tool
    executor = ToolExecutor({"python": python_tool(LIMITS)}, timeout_s=20)
    try:
        records = executor.run_turn(_call("python", code="while True: pass")
                                    + _call("python", code="print(sum(range(10)))"))
    finally:
        executor.close()
    assert records[0].error and "CPU-time limit" in records[0].result
    assert not records[1].error and records[1].result.strip() == "45"


def test_user_tools_and_environments_load_from_files(tmp_path):
    file = tmp_path / "my_agent.py"
    file.write_text(
        "from parallel_models.rl.agents.schema import Tool\n"
        "def lookup(key):\n    return {'a': '1'}.get(key, 'none')\n"
        "lookup.openai_schema = {'type': 'function', 'function': {'name': 'lookup',\n"
        "    'description': 'look up', 'parameters': {'type': 'object',\n"
        "    'properties': {'key': {'type': 'string'}}, 'required': ['key']}}}\n"
        "ECHO = Tool('echo', 'echo', {'type': 'object', 'properties': {'s': {'type': "
        "'string'}}}, lambda s='': s)\n"
        "NOT_A_TOOL = print\n"
        "class Env:\n    def reset(self, record):\n        return []\n"
        "    def step(self, turn_text, turn_ids):\n        return [], 1, True\n")
    tools = resolve_tools([f"{file}:lookup", f"{file}:ECHO", "calculator"])
    assert sorted(tools) == ["calculator", "echo", "lookup"]
    assert tools["lookup"](key="a") == "1" and tools["echo"](s="hi") == "hi"
    assert tools["lookup"].openai_schema()["function"]["parameters"]["required"] == ["key"]
    with pytest.raises(ConfigError, match="neither a Tool nor"):
        resolve_tools([f"{file}:NOT_A_TOOL"])
    with pytest.raises(ConfigError, match="unknown tool 'calculater'.*did you mean"):
        resolve_tools(["calculater"])
    with pytest.raises(ConfigError, match="two tools are named 'calculator'"):
        resolve_tools(["calculator", "calculator"])
    env = load_environment(f"{file}:Env")()
    assert env.reset({}) == []
    result = step_result(env.step("text", [1, 2]))
    assert (result.messages, result.reward, result.done) == ([], 1.0, True)
    with pytest.raises(ValueError, match="step\\(\\) must return"):
        step_result(None)
    with pytest.raises(ConfigError, match="has no reset"):
        load_environment(f"{file}:lookup")
