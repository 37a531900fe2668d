"""The asynchronous multi-turn driver (parallel_models/rl/agents/async_turns.py) and the turns
over the rollout server's ``/generate`` (server_turns.py) against the turn-synchronous driver on
the in-process engine (the previous behaviour, the oracle): the same token streams, masks,
log-probs, tool traces and metrics, with a scripted policy on a scripted continuous engine and
with a tiny random model on the real engines (greedy, and seeded sampling); rows waiting on a
tool leave the decode batch while the others go on; turns end right after ``</tool_call>``."""

import time

import pytest
import torch

from parallel_models.inference import SamplingParams
from parallel_models.inference.continuous import Sample
from parallel_models.rl.agents.executor import ToolExecutor
from parallel_models.rl.agents.multi_turn import MultiTurnLimits, MultiTurnRollout
from parallel_models.rl.agents.schema import Tool
from parallel_models.rl.agents.server_turns import ServerTurnEngine
from parallel_models.rl.agents.tools import resolve_tools
from parallel_models.testing import run_distributed
from tests.rl.test_agent_rollout import EOS, TOK, Inner, ScriptedEngine, call, stream


class ScriptedContinuous:
    """A continuous engine over :class:`ScriptedEngine`'s script: a request's turn is scripted
    at submit, one token per step; ``log`` records submits and finishes (by prompt text)."""

    def __init__(self, scripted, log):
        self.scripted, self.log = scripted, log
        self.running, self.max_row_tokens = [], 10_000
        self.steps_while = []  # per step: the prompts decoding
        self.steps, self.released, self.resumed = 0, [], []

    @property
    def has_work(self):
        return bool(self.running)

    def submit(self, prompt, params, *, stop_ids=(), stop_sequences=(), on_done=None,
               keep_kv=False, resume=None):
        turn = self.scripted.turn(prompt, params.max_new_tokens, stop_sequences)
        key = next(TOK.decode(list(k), skip_special_tokens=True) for k in self.scripted.script
                   if tuple(prompt[:len(k)]) == k)
        self.log.append(("submit", key, time.monotonic()))
        self.resumed.append((key, resume))
        req = type("Req", (), {})()
        req.samples, req.key, req.turn, req.on_done = [Sample()], key, turn, on_done
        req.kept = ("kept", key) if keep_kv else None
        self.running.append(req)
        return req

    def release_kept(self, kept):
        self.released.append(kept)

    def step(self):
        self.steps += 1
        self.steps_while.append([r.key for r in self.running])
        for req in list(self.running):
            s = req.samples[0]
            k = len(s.token_ids)
            s.token_ids.append(req.turn["token_ids"][k])
            s.log_probs.append(req.turn["log_probs"][k])
            if len(s.token_ids) == len(req.turn["token_ids"]):
                self.running.remove(req)
                self.log.append(("done", req.key, time.monotonic()))
                req.on_done(req)


class ScriptedRolloutEngine(ScriptedEngine):
    """:class:`ScriptedEngine` with a continuous engine (the asynchronous driver's seam)."""

    keep_kv, continuous = True, True

    def __init__(self, script):
        super().__init__(script)
        self.log = []
        self.cont = ScriptedContinuous(self, self.log)

    def continuous_engine(self, longest_prompt, longest_row, rows, kv_budget_tokens=None):
        return self.cont


def _slow(seconds: float) -> str:
    time.sleep(seconds)
    return "late"


SLOW = Tool("slow", "sleeps", {"type": "object", "properties": {"seconds": {"type": "number"}},
                               "required": ["seconds"]}, _slow)


def _scripts():
    calc = call("calculator", expression="(2+3)*4")
    return {"a": [call("slow", seconds=0.4), "done a"],
            "b": ["b says " + calc + " and then more", "b" * 30],
            "c": ["<tool_call>{oops</tool_call>", call("nope"), "x" * 120],
            "d": ["no tools"]}


def _run(engine_cls, limits, script=None):
    script = _scripts() if script is None else script
    engine = engine_cls({k: list(v) for k, v in script.items()})
    table = resolve_tools(["calculator"])
    table["slow"] = SLOW
    executor = ToolExecutor(table, timeout_s=5)
    mt = MultiTurnRollout(Inner(engine), TOK, limits, executor=executor)
    try:
        batch = mt.generate([TOK(p)["input_ids"] for p in script],
                            SamplingParams(n=1, max_new_tokens=200))
    finally:
        executor.close()
    return mt, batch, engine


def _same_batches(a, b):
    for field in ("sequences", "attention_mask", "response_mask", "prompt_lengths",
                  "group_index"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert torch.allclose(a.rollout_log_probs, b.rollout_log_probs, atol=1e-6)
    assert a.columns["conversation"] == b.columns["conversation"]
    strip = [[{k: v for k, v in t.items() if k != "seconds"} for t in row]
             for row in a.columns["tool_trace"]]
    assert strip == [[{k: v for k, v in t.items() if k != "seconds"} for t in row]
                     for row in b.columns["tool_trace"]]


def test_scripted_async_equals_turn_synchronous_and_rows_on_tools_leave_the_batch():
    limits = MultiTurnLimits(max_turns=3, max_turn_tokens=100)
    sync, sync_batch, _ = _run(ScriptedEngine, limits)
    assert not sync.asynchronous
    mt, batch, engine = _run(ScriptedRolloutEngine, limits)
    assert mt.asynchronous
    _same_batches(sync_batch, batch)
    for key in ("rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_errors",
                *(f"rollout/cut_{c}" for c in ("max_turns", "total_tokens", "turn_tokens"))):
        assert mt.metrics[key] == sync.metrics[key], key
    # the turn stops right after </tool_call>: " and then more" is never generated
    b_turns = [m["content"] for m in batch.columns["conversation"][1] if m["role"] ==
               "assistant"]
    assert b_turns[0] == "b says " + call("calculator", expression="(2+3)*4")
    _, response, mask, _ = stream(batch, 1)
    closing = response.index(EOS)  # the template's end of turn after the call, masked 0
    assert mask[closing] == 0 and mask[closing - 1] == 1
    # b's second turn was decoded while a's tool was still sleeping: a left the batch
    log = engine.log
    a_back = [t for kind, key, t in log if kind == "submit" and key == "a"][1]
    b_second_done = [t for kind, key, t in log if kind == "done" and key == "b"][1]
    assert b_second_done < a_back
    assert any("a" not in keys and "b" in keys for keys in engine.cont.steps_while)
    # every turn keeps its KV, the next one resumes from it, the last one's is given back
    seen = set()
    for key, resume in engine.cont.resumed:
        assert resume == (("kept", key) if key in seen else None), key
        seen.add(key)
    assert sorted(engine.cont.released) == sorted(("kept", k) for k in _scripts())


def test_turns_run_to_eos_with_stop_at_call_end_off():
    limits = MultiTurnLimits(max_turns=2, stop_at_call_end=False)
    script = {"b": ["b says " + call("calculator", expression="1+1") + " and then more", "ok"]}
    mt, batch, _ = _run(ScriptedRolloutEngine, limits, script)
    turns = [m["content"] for m in batch.columns["conversation"][0] if m["role"] ==
             "assistant"]
    assert turns == [script["b"][0], "ok"]
    assert batch.columns["tool_trace"][0][0]["result"] == "2"


ENV = '''
class Env:
    """Three turns: after each the user says "go on"."""

    def reset(self, record):
        return []

    def step(self, turn_text, turn_ids):
        return [{"role": "user", "content": "go on"}], 0.0, False
'''


class EngineBehindServer:
    """A ``ServerRollout`` stand-in whose client answers ``/generate`` with the in-process engine
    (the server's semantics: the request's stop ids, no per-prompt caps, no stop sequences)."""

    def __init__(self, engine, eos):
        self.eos_token_id, self.pad_token_id, self.device = eos, 0, engine.device
        self.engine, self.client, self.requests = engine, self, []

    def request_seed(self):
        return 5

    def generate(self, prompts, params, *, return_text, return_routes, prompt_seeds):
        self.requests.append(params.max_new_tokens)
        samples = self.engine.generate_samples(prompts, params, prompt_seeds=prompt_seeds)
        return {"results": [{"prompt_token_ids": p, "samples": [s]}
                            for p, s in zip(prompts, samples)]}


def _spy_continuous(engine) -> list:
    """The continuous engines ``engine`` makes, appended as they are made."""
    made, make = [], engine.continuous_engine

    def spy(*args, **kwargs):
        made.append(make(*args, **kwargs))
        return made[-1]

    engine.continuous_engine = spy
    return made


def _tiny_model_both_ways(path: str, env_file: str) -> dict:
    import parallel_models as pm
    from parallel_models.inference import RolloutEngine
    from parallel_models.rl.agents.environment import load_environment
    from parallel_models.tokenizer import build_builtin_tokenizer

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    tok = build_builtin_tokenizer()
    prompts = [tok(p)["input_ids"] for p in ("what is 2+2?", "hi", "tell me a story")]
    out = {}
    for name, params, seeds in (("greedy", SamplingParams(greedy=True, max_new_tokens=6), None),
                                ("seeded", SamplingParams(n=2, max_new_tokens=6), [11, 12, 13])):
        for way in ("sync", "async", "server"):
            engine = RolloutEngine(model, eos_token_id=tok.eos_token_id)
            made = _spy_continuous(engine)
            executor = ToolExecutor(resolve_tools(["calculator"]))
            turns = None
            if way == "server":  # turns as /generate requests, cut here (server_turns.py)
                server = EngineBehindServer(engine, tok.eos_token_id)
                turns = ServerTurnEngine(server)
            mt = MultiTurnRollout(Inner(engine), tok, MultiTurnLimits(
                max_turns=3, max_total_tokens=36), executor=executor,
                environment=load_environment(f"{env_file}:Env"),
                asynchronous=way == "async", engine=turns)
            batch = mt.generate(prompts, params, prompt_seeds=seeds)
            executor.close()
            out[(name, way)] = {
                k: getattr(batch, k) for k in ("sequences", "attention_mask",
                                               "response_mask", "rollout_log_probs")}
            out[(name, way)]["turns"] = mt.metrics["rollout/turns_mean"]
            out[(name, way)]["cut_total"] = mt.metrics["rollout/cut_total_tokens"]
            if way == "server":
                out[(name, way)]["requests"] = server.requests
            if way == "async":
                # a re-entry's new tokens: prefilled or fed through a decode step
                out[(name, way)]["prefilled"] = made[0].prefilled_tokens
                out[(name, way)]["fed"] = made[0].decode_fed_tokens
                out[(name, way)]["prompt_lengths"] = [len(p) for p in prompts]
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from parallel_models.testing import save_tiny_hf_model

    root = tmp_path_factory.mktemp("agent_async")
    path = str(root / "tiny")
    save_tiny_hf_model(path, "llama", seed=3, vocab_size=74)  # the builtin tokenizer's vocab
    env_file = root / "env.py"
    env_file.write_text(ENV)
    return run_distributed(_tiny_model_both_ways, 1, path, str(env_file), timeout=300)[0]


@pytest.mark.parametrize("way", ["async", "server"])
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_tiny_model_equals_turn_synchronous(tiny_model, kind, way):
    sync, other = tiny_model[(kind, "sync")], tiny_model[(kind, way)]
    assert sync["turns"] == other["turns"] == 2.0  # the total budget cuts the 2nd turn
    assert sync["cut_total"] == other["cut_total"] == 1.0
    for k in ("sequences", "attention_mask", "response_mask"):
        assert torch.equal(sync[k], other[k]), k
    assert (sync["response_mask"] == 0).any()  # holes: the appended "go on" messages
    assert torch.allclose(sync["rollout_log_probs"], other["rollout_log_probs"], atol=1e-5)
    if way == "server":  # one request per turn, for the largest cap
        assert len(other["requests"]) == 2 and other["requests"][0] == 6


def test_reentry_prefills_only_the_appended_tokens(tiny_model):
    """Each re-entry runs the turn's last generated id (never fed to the model) and the
    appended messages' ids (in the next decode step: few of them): the conversation before them
    keeps its KV."""
    run = tiny_model[("greedy", "async")]
    mask = run["response_mask"]
    real = run["attention_mask"][:, -mask.shape[1]:] == 1  # (not the padding)
    appended = int(((mask == 0) & real).sum())
    reentries = int(((mask[:, 1:] == 1) & (mask[:, :-1] == 0) & real[:, 1:]).sum())
    assert reentries == 3  # one per conversation (two turns each)
    assert run["prefilled"] + run["fed"] == sum(run["prompt_lengths"]) + appended + reentries
    assert run["fed"] == appended + reentries  # short re-entries: run in decode steps


def test_server_samples_are_cut_as_if_generation_had_stopped():
    from parallel_models.rl.agents.server_turns import cut_sample

    sample = {"token_ids": [5, 6, 7, 8, 9, 2], "log_probs": [-.1, -.2, -.3, -.4, -.5, -.6],
              "routes": [[[i]] for i in range(3 + 6)]}  # 3 prompt positions + 6 generated
    cut = cut_sample(sample, 3, 10, {2}, [[7, 8]])
    assert cut == {"token_ids": [5, 6, 7, 8], "log_probs": [-.1, -.2, -.3, -.4],
                   "finish_reason": "stop", "routes": [[[i]] for i in range(3 + 4)]}
    assert cut_sample(sample, 3, 3, {2}, [[7, 8]])["token_ids"] == [5, 6, 7]  # the cap
    assert cut_sample(sample, 3, 3, {2}, [[7, 8]])["finish_reason"] == "length"
    assert cut_sample(sample, 3, 10, {2}, [])["token_ids"] == [5, 6, 7, 8, 9, 2]
    assert cut_sample(sample, 3, 10, {9}, [[1, 5]])["token_ids"] == [5, 6, 7, 8, 9]
