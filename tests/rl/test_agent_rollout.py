"""The multi-turn rollout (parallel_models/rl/agents/multi_turn.py) with a scripted policy: the
model's turns are forced to fixed token ids, and the token stream must be exactly what the chat
template renders for the whole conversation (transformers' ``apply_chat_template`` is the
oracle), with masks 1 on the model's ids and 0 on the appended ones, the tool results, a bad tool
call, a timeout, the environment's rewards and each budget cut."""

import json
import time

import pytest
import torch

from parallel_models.inference import SamplingParams
from parallel_models.rl.agents.executor import ToolExecutor
from parallel_models.rl.agents.multi_turn import MultiTurnLimits, MultiTurnRollout
from parallel_models.rl.agents.schema import Tool
from parallel_models.rl.agents.tools import resolve_tools
from parallel_models.tokenizer import build_builtin_tokenizer

TOK = build_builtin_tokenizer()
EOS = TOK.eos_token_id


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class ScriptedEngine:
    """An engine whose turns are scripted per prompt: ``script[prompt][t]`` is turn t's text
    (EOS appended unless it ends with ``...``, a turn cut by its cap); log-probs are
    -(position + 1) / 100 so their placement can be checked."""

    pad_token_id, eos_token_id, device = 0, EOS, torch.device("cpu")

    def __init__(self, script):
        self.script = {tuple(TOK(p)["input_ids"]): turns for p, turns in script.items()}
        self.calls = []

    def stop_ids(self, params):
        return params.stop_ids(self.eos_token_id)

    def turn(self, context, cap, stop_sequences=()):
        """The scripted turn after ``context``: its ids up to the cap or the first stop
        sequence (kept), as the engine stops."""
        key = next(k for k in self.script if tuple(context[:len(k)]) == k)
        text = self.script[key].pop(0)
        ids = TOK(text, add_special_tokens=False)["input_ids"] + [EOS]
        for end in range(1, len(ids) + 1):
            if any(ids[max(0, end - len(s)):end] == list(s) for s in stop_sequences):
                ids = ids[:end]
                break
        ids = ids[:cap]
        return {"token_ids": ids, "log_probs": [-(k + 1) / 100 for k in range(len(ids))],
                "finish_reason": "stop" if ids[-1] == EOS else "length"}

    def generate_samples(self, prompts, params, max_new_tokens=None, prompt_seeds=None,
                         stop_sequences=()):
        self.calls.append(list(max_new_tokens))
        return [self.turn(context, cap, stop_sequences)
                for context, cap in zip(prompts, max_new_tokens)]


class Inner:
    pushes_weights = False

    def __init__(self, engine):
        self.engine = engine


def rollout(script, limits, tools=("calculator",), environment=None, timeout_s=5.0):
    engine = ScriptedEngine(script)
    table = resolve_tools(list(tools))

    def slow(seconds: float) -> str:
        time.sleep(seconds)
        return "late"

    table["slow"] = Tool("slow", "sleeps", {"type": "object", "properties": {
        "seconds": {"type": "number"}}, "required": ["seconds"]}, slow)
    executor = ToolExecutor(table, timeout_s=timeout_s)
    mt = MultiTurnRollout(Inner(engine), TOK, limits, executor=executor,
                          environment=environment)
    prompts = [TOK(p)["input_ids"] for p in script]
    try:
        batch = mt.generate(prompts, SamplingParams(n=1, max_new_tokens=200, temperature=1.0))
    finally:
        executor.close()
    return batch, mt.metrics, engine


def stream(batch, b):
    P = batch.sequences.shape[1] - batch.response_mask.shape[1]
    k = int(batch.attention_mask[b, P:].sum())
    plen = int(batch.prompt_lengths[b])
    return (batch.sequences[b, P - plen:P].tolist(), batch.sequences[b, P:P + k].tolist(),
            batch.response_mask[b, :k].tolist(), batch.rollout_log_probs[b, :k].tolist())


def rendered(messages):
    """The oracle: the whole conversation through transformers' chat template, tokenized."""
    text = TOK.apply_chat_template(messages, tokenize=False)
    return TOK(text, add_special_tokens=False)["input_ids"]


def check_stream(batch, b, prompt_text, turns, ends_with_eos=True, last_appended=False):
    """Row b is the raw prompt, then the conversation [turns[0], tool results, turns[1], ...]
    exactly as the chat template renders it after the first assistant opening (the tool results
    as the row's conversation holds them: the trace's, unless capped), with the turns' ids
    masked 1 and their log-probs."""
    prompt, response, mask, logps = stream(batch, b)
    assert prompt == TOK(prompt_text)["input_ids"]
    trace = batch.columns["tool_trace"][b]
    # the appended messages as the row's conversation holds them (tool results capped)
    messages = batch.columns["conversation"][b]
    assert messages[0] == {"role": "user", "content": prompt_text}
    assert [m["content"] for m in messages if m["role"] == "assistant"] == turns
    assert [m["content"] for m in messages if m["role"] == "tool"] == \
        [r["result"] for r in trace if r["turn"] < len(turns)] or any(
            "[truncated]" in m["content"] for m in messages)
    want = TOK(TOK.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=last_appended),
               add_special_tokens=False)["input_ids"]
    head = len(TOK("<s>user: " + prompt_text + "\nassistant: ",
                   add_special_tokens=False)["input_ids"])
    want = want[head:]
    if not last_appended:
        want = want[:-1]  # the template's newline after the last turn's EOS is not generated
    last_call = turns[-1].endswith("</tool_call>")
    if not ends_with_eos or last_call:
        want = want[:-1]  # a turn cut by a budget or ending a call has no EOS
    assert response == want
    # a turn ends at EOS, or right after its tool call (no EOS: the template closes it)
    model = [TOK(text, add_special_tokens=False)["input_ids"] +
             ([] if text.endswith("</tool_call>") else [EOS]) for text in turns]
    if not ends_with_eos and not last_call:
        model[-1] = model[-1][:-1]
    assert [i for i, m in zip(response, mask) if m] == [i for ids in model for i in ids]
    got = [lp for lp, m in zip(logps, mask) if m]
    assert got == pytest.approx([-(k + 1) / 100 for ids in model for k in range(len(ids))])
    assert all(lp == 0 for lp, m in zip(logps, mask) if not m)
    assert 0 in mask or len(turns) == 1  # holes where tool results were appended
    return trace


@pytest.mark.timed  # its limits hold with the background stopped: background_lane.py
def test_conversations_with_good_and_bad_tool_calls_and_a_timeout():
    a_turns = ["let me compute " + call("calculator", expression="(2+3)*4"), "it is 20"]
    b_turns = ["<tool_call>{oops</tool_call>", call("nope", x=1),
               call("calculator", expr="1"), "i give up"]
    c_turns = [call("slow", seconds=3), "too slow"]
    script = {"what is (2+3)*4?": list(a_turns), "try tools": list(b_turns),
              "wait": list(c_turns)}
    start = time.monotonic()
    batch, metrics, _ = rollout(script, MultiTurnLimits(max_turns=5), timeout_s=0.5)
    assert time.monotonic() - start < 3.0
    trace = check_stream(batch, 0, "what is (2+3)*4?", a_turns)
    assert [(r["name"], r["result"], r["error"]) for r in trace] == [("calculator", "20", False)]
    trace = check_stream(batch, 1, "try tools", b_turns)
    assert [r["error"] for r in trace] == [True, True, True]
    assert "not valid json" in trace[0]["result"].lower()
    assert "unknown tool 'nope'" in trace[1]["result"]
    assert "missing required argument 'expression'" in trace[2]["result"]
    trace = check_stream(batch, 2, "wait", c_turns)
    assert trace[0]["error"] and "did not finish within 0.5 s" in trace[0]["result"]
    assert batch.columns["conversation"][0][-1] == {"role": "assistant", "content": "it is 20"}
    assert metrics["rollout/turns_mean"] == pytest.approx((2 + 4 + 2) / 3)
    assert metrics["rollout/tool_calls_mean"] == pytest.approx((1 + 3 + 1) / 3)
    assert metrics["rollout/tool_errors"] == 4
    assert metrics["rollout/tool_time_s"] >= 0.5
    # (the turn-synchronous driver: every turn's tools phase, the 0.5 s timeout among them)
    assert 0.5 <= metrics["rollout/idle_on_tools_s"] <= metrics["rollout/multi_turn_s"]
    assert all(metrics[f"rollout/cut_{c}"] == 0 for c in
               ("max_turns", "total_tokens", "turn_tokens", "tool_response"))
    assert batch.group_index.tolist() == [0, 1, 2]


def test_each_budget_cut():
    calc = call("calculator", expression="12345678 * 9")
    script = {"turns": [calc, calc, "never"],            # max_turns=2: ends after turn 2
              "long": ["x" * 140],                        # max_turn_tokens=100: cut mid-turn
              "big": [calc, "ok"]}                        # tool result capped at 3 tokens
    batch, metrics, engine = rollout(script, MultiTurnLimits(
        max_turns=2, max_turn_tokens=100, max_tool_response_tokens=3))
    check_stream(batch, 0, "turns", [calc, calc])
    check_stream(batch, 1, "long", ["x" * 100], ends_with_eos=False)
    trace = batch.columns["tool_trace"][2]
    assert trace[0]["result"] == "111111102"  # the trace keeps the tool's whole result
    conversation = batch.columns["conversation"][2]
    assert conversation[2] == {"role": "tool", "name": "calculator",
                               "content": "111 [truncated]"}
    assert metrics["rollout/cut_max_turns"] == pytest.approx(1 / 3)
    assert metrics["rollout/cut_turn_tokens"] == pytest.approx(1 / 3)
    assert metrics["rollout/cut_tool_response"] == pytest.approx(2 / 3)  # rows 0 and 2
    assert engine.calls[0] == [100, 100, 100]  # the per-turn cap reaches the engine

    # the total budget: the first turn fits, the tool message would not: nothing is appended
    first = TOK(calc, add_special_tokens=False)["input_ids"]
    batch, metrics, engine = rollout({"total": [calc, "x"]},
                                     MultiTurnLimits(max_turns=3,
                                                     max_total_tokens=len(first) + 5))
    check_stream(batch, 0, "total", [calc])
    assert metrics["rollout/cut_total_tokens"] == 1.0
    assert engine.calls == [[len(first) + 5]]
    # a turn that reaches what is left of the total budget is cut by it
    appended = len("\ntool: 111111102\nassistant: ")  # one token per character
    budget = len(first) + 1 + appended + 10
    batch, metrics, engine = rollout({"total": [calc, "y" * 50]},
                                     MultiTurnLimits(max_turns=3, max_total_tokens=budget))
    assert metrics["rollout/cut_total_tokens"] == 1.0
    assert engine.calls == [[budget], [10]]
    check_stream(batch, 0, "total", [calc, "y" * 10], ends_with_eos=False)


class CountdownEnv:
    """A game: the model must say "done"; each turn is rewarded -0.1, "done" +1 and ends."""

    def reset(self, record):
        return [{"role": "system", "content": "play"},
                {"role": "user", "content": f"say done, {record['name']}"}]

    def step(self, turn_text, turn_ids):
        # the generated ids, as generated: up to EOS or the end of the tool call
        assert turn_ids[-1] == EOS or turn_text.endswith("</tool_call>")
        if "done" in turn_text:
            return [], 1.0, True
        return [{"role": "user", "content": "not yet"}], -0.1, False


def test_environment_messages_rewards_and_the_rendered_prompt():
    engine = ScriptedEngine({})
    prompt_messages = CountdownEnv().reset({"name": "bob"})
    prompt = TOK(TOK.apply_chat_template(prompt_messages, add_generation_prompt=True,
                                         tokenize=False), add_special_tokens=False)["input_ids"]
    engine.script = {tuple(prompt): ["hello " + call("calculator", expression="1+1"),
                                     "done"]}
    mt = MultiTurnRollout(Inner(engine), TOK, MultiTurnLimits(max_turns=4),
                          executor=ToolExecutor(resolve_tools(["calculator"])),
                          environment=CountdownEnv)
    batch = mt.generate([[1, 5, 6]], SamplingParams(n=1, max_new_tokens=100),
                        records=[{"name": "bob"}])
    mt.executor.close()
    P = batch.sequences.shape[1] - batch.response_mask.shape[1]
    assert batch.sequences[0, P - len(prompt):P].tolist() == prompt
    k = int(batch.attention_mask[0, P:].sum())
    turns = ["hello " + call("calculator", expression="1+1"), "done"]
    messages = prompt_messages + [{"role": "assistant", "content": turns[0]},
                                  {"role": "tool", "content": "2"},
                                  {"role": "user", "content": "not yet"},
                                  {"role": "assistant", "content": turns[1]}]
    whole = TOK(TOK.apply_chat_template(messages, tokenize=False),
                add_special_tokens=False)["input_ids"][:-1]  # no trailing newline
    assert prompt + batch.sequences[0, P:P + k].tolist() == whole
    assert batch.columns["environment_reward"] == [pytest.approx(0.9)]
    assert mt.metrics["rollout/turns_mean"] == 2


class GoOnEnv:
    """Says "go on" after every turn; never done (max_turns ends it)."""

    def reset(self, record):
        return []

    def step(self, turn_text, turn_ids):
        return [{"role": "user", "content": "go on"}], None, False


def test_a_turn_cut_by_its_cap_is_closed_by_the_template_and_the_conversation_goes_on():
    engine = ScriptedEngine({"go": ["z" * 30, "ok"]})
    mt = MultiTurnRollout(Inner(engine), TOK, MultiTurnLimits(max_turns=2, max_turn_tokens=10),
                          environment=GoOnEnv)
    batch = mt.generate([TOK("go")["input_ids"]], SamplingParams(n=1, max_new_tokens=100))
    prompt, response, mask, _ = stream(batch, 0)
    closing = TOK("</s>\nuser: go on\nassistant: ", add_special_tokens=False)["input_ids"]
    ok = TOK("ok", add_special_tokens=False)["input_ids"] + [EOS]
    z10 = TOK("z" * 10, add_special_tokens=False)["input_ids"]
    assert response == z10 + closing + ok
    # the closing EOS is the template's, not the model's: masked 0
    assert mask == [1] * 10 + [0] * len(closing) + [1] * len(ok)
    assert mt.metrics["rollout/cut_turn_tokens"] == 1.0 and mt.metrics["rollout/turns_mean"] == 2
    assert mt.metrics["rollout/cut_max_turns"] == 1.0
