"""Multi-turn (agentic) rollout decode throughput with slow tools vs the same tokens without
tool latency (issue 34): rows waiting on a tool must not stall the others.

    python bench/agentic_rollout.py [--conversations 256] [--turns 3] [--turn-tokens 128]
                                    [--latency-ms 50] [--reentry-wait-steps 8] [--out r.json]
    python bench/agentic_rollout.py --repeats 3 --sweep-wait-steps 0 8 24 48   # + the gathering
    python bench/agentic_rollout.py --compare-prefilled-reentries   # + re-entries prefilled
    python bench/agentic_rollout.py --tiny      # a CPU smoke run (tests/rl/test_agentic_bench.py)

Workload: ``--conversations`` prompts (the built-in character tokenizer, random text of 64..192
characters), one sample each, greedy with ``ignore_eos``, ``--turns`` model turns per
conversation. Every turn calls one tool (a bench tool call format that reads every turn as a call
of ``wait``); the tool sleeps ``--latency-ms`` and answers ``ok``. Turn lengths vary per
conversation and turn, ``--turn-tokens`` x [0.5, 1.5) (so rows end their turns at different
steps, as real agents do). Model: the 0.89B Llama shape of bench/train_bench.py with the
tokenizer's 74-token vocab (``--hidden ...`` change it), random weights, bf16; the rollout
engine batches continuously (``kv_budget_tokens=auto``, KV kept between runs so CUDA graphs are
captured once, by a warm-up run; ``--tiny`` runs each case once, without it).

Cases, the same conversations and the same work in each:

- ``no_latency``: the tool answers at once -- the same tokens without tool time (the
  asynchronous driver);
- ``no_latency_turn_synchronous``: the same with the turn-synchronous driver;
- ``tools``: the tool sleeps ``--latency-ms`` (the asynchronous driver: a row on a tool leaves
  the decode batch keeping its KV, the others keep decoding, it re-enters prefilling only the
  new tokens; ``async_turns.py``);
- ``tools_turn_synchronous``: the same with the turn-synchronous driver (every row waits for the
  slowest turn and the tools), for comparison.

The same work: every turn runs to its cap (greedy, ``ignore_eos``, no stop sequence), so every
case generates and appends the same number of tokens per turn of every conversation whatever ids
are drawn; ``same_work`` checks it (per conversation, the lengths of its generated and appended
runs). ``same_tokens`` says whether the ids are the same too (on the CPU in fp32 they are; in
bf16 a different batch composition may change a greedy draw, which changes no count).

Each case runs once to warm up (CUDA graphs) and then ``--repeats`` times (default 3). Reported
per case: seconds (the median of the timed runs, with their min and max), model tokens, decode
throughput (model tokens / s at the median), prefill tokens and calls (a re-entry counts its new
tokens only), the re-entries' new tokens run in decode steps instead (``decode_fed_tokens``:
at most the engine's ``decode_extension_tokens`` a re-entry, ``--decode-extension-tokens``;
``--compare-prefilled-reentries`` adds the tools case with every re-entry prefilled), decode
steps and their mean rows, evicted kept regions, the engine's seconds in
prefills and in decode steps (``prefill_s``, ``decode_s``: host wall time, each waiting for its
tokens) and the seconds no row decoded because every open conversation waited on its tools
(``idle_on_tools_s``; counts and seconds: the last run; the rest of a run is the drivers' own
host work). The
result: ``throughput_ratio`` = tools / the baseline, the faster of the two no-latency cases (the
same tokens as fast as this engine makes them; target >= 0.8), at the medians, and
``throughput_ratio_worst``: the slowest tools run against the fastest baseline run.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from common import add_llama_shape_args, build_random_llama, report

TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)


def every_turn_calls_wait(text: str):
    """The bench's tool call format: every turn is one call of ``wait``."""
    from parallel_models.utils.tool_calls import ParsedCall

    return [ParsedCall(name="wait", raw=text)]


def build_rollout(model, tok, args, latency_s: float, asynchronous: bool, longest_prompt: int):
    from parallel_models.inference import RolloutEngine
    from parallel_models.rl.agents.executor import ToolExecutor
    from parallel_models.rl.agents.multi_turn import MultiTurnLimits, MultiTurnRollout
    from parallel_models.rl.agents.schema import Tool

    def wait() -> str:
        if latency_s:
            time.sleep(latency_s)
        return "ok"

    tool = Tool("wait", "waits", {"type": "object", "properties": {}}, wait)
    executor = ToolExecutor({"wait": tool}, timeout_s=60, max_workers=args.conversations,
                            call_format="bench_every_turn")
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, kv_budget_tokens="auto",
                           max_rows=args.conversations, keep_kv=True)
    longest = int(args.turn_tokens * 1.5)
    limits = MultiTurnLimits(max_turns=args.turns, max_turn_tokens=longest,
                             max_total_tokens=args.turns * (longest + 64))
    # the continuous engine sized for whole conversations, as the asynchronous driver sizes it,
    # so the turn-synchronous driver's later (longer) turns do not wait for KV either
    cont = engine.continuous_engine(longest_prompt, longest_prompt + limits.max_total_tokens,
                                    args.conversations)
    if args.decode_extension_tokens is not None:  # re-entries fed through decode steps or not
        cont.decode_extension_tokens = args.decode_extension_tokens
    inner = type("Inner", (), {"engine": engine, "pushes_weights": False})()
    mt = MultiTurnRollout(inner, tok, limits, executor=executor, asynchronous=asynchronous)
    mt.reentry_wait_steps = args.reentry_wait_steps
    span = max(1, args.turn_tokens)

    def turn_cap(c, max_new_tokens):  # varied turn lengths, the same in every case
        return args.turn_tokens // 2 + (c.prompt_length * 7 + c.turns * 13) % span

    mt.turns.turn_cap = turn_cap
    return mt, executor


def run_case(model, tok, prompts, args, latency_s: float, asynchronous: bool) -> dict:
    from parallel_models.inference import SamplingParams

    mt, executor = build_rollout(model, tok, args, latency_s, asynchronous,
                                 max(map(len, prompts)))
    params = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=int(
        args.turn_tokens * 1.5))
    timed = []
    try:
        # a warm-up run (graphs), then --repeats timed ones (the CPU smoke: one, untimed warm-up)
        for i in range(args.repeats if args.tiny else 1 + args.repeats):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            before = engine_counts(mt.engine)
            start = time.perf_counter()
            batch = mt.generate(prompts, params)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if args.tiny or i > 0:
                timed.append(time.perf_counter() - start)
            counts = {k: v - before.get(k, 0) for k, v in engine_counts(mt.engine).items()}
    finally:
        executor.close()
    seconds = statistics.median(timed)
    tokens = int(batch.response_mask.sum())
    steps = counts.pop("decode_rows_sum", 0)
    for key in ("prefill_s", "decode_s"):  # (the last run's)
        counts[key] = round(counts.get(key, 0.0), 4)
    return {"seconds": round(seconds, 4), "seconds_min": round(min(timed), 4),
            "seconds_max": round(max(timed), 4), "model_tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1), **counts,
            "decode_rows_mean": round(steps / max(1, counts.get("decode_steps", 0)), 1),
            "turns_mean": mt.metrics["rollout/turns_mean"],
            "tool_calls_mean": mt.metrics["rollout/tool_calls_mean"],
            "tool_time_s": round(mt.metrics["rollout/tool_time_s"], 3),
            "idle_on_tools_s": round(mt.metrics["rollout/idle_on_tools_s"], 4),
            "_streams": batch.sequences[batch.attention_mask.bool()].tolist(),
            "_work": [runs(m) for m in batch.response_mask.tolist()]}


def engine_counts(engine) -> dict:
    """The continuous engine's work counters so far (``ContinuousEngine``)."""
    cont = engine._continuous
    if cont is None:
        return {}
    return {"prefill_tokens": cont.prefilled_tokens, "prefill_calls": cont.prefill_calls,
            "decode_steps": cont.decode_steps, "decode_rows_sum": cont.decode_rows,
            "decode_fed_tokens": cont.decode_fed_tokens,
            "evicted": cont.scheduler.evicted, "prefill_s": cont.prefill_seconds,
            "decode_s": cont.decode_seconds}


def runs(mask: list) -> list:
    """``mask``'s runs as (value, length) pairs: a conversation's generated / appended spans."""
    return [(m, len(list(run))) for m, run in itertools.groupby(mask)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_llama_shape_args(ap, seq=False)
    ap.add_argument("--conversations", type=int, default=256)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=128)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--reentry-wait-steps", type=int, default=None, help="the asynchronous "
                    "driver's gathering of re-entries (default: its own, async_turns.py)")
    ap.add_argument("--sweep-wait-steps", type=int, nargs="*", default=[],
                    help="also run the tools case at each of these re-entry gathering steps "
                         "(cases tools_wait<W>; their ratios in ratio_by_wait_steps)")
    ap.add_argument("--decode-extension-tokens", type=int, default=None, help="re-entries "
                    "with at most this many new tokens run in the next decode step (default: "
                    "the engine's; 0: every re-entry prefilled)")
    ap.add_argument("--compare-prefilled-reentries", action="store_true", help="also run the "
                    "tools case with every re-entry prefilled (case tools_prefilled_reentries: "
                    "the behaviour before re-entries were fed through decode steps)")
    ap.add_argument("--tiny", action="store_true", help="a CPU smoke run: a tiny model, 8 "
                    "conversations, 8-token turns")
    ap.add_argument("--skip-sync", action="store_true", help="leave out the case "
                    "tools_turn_synchronous (the baseline's two no-latency cases always run)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per case after its "
                    "warm-up; seconds = their median, with min and max")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.repeats = 1
        for k, v in TINY.items():
            setattr(args, k, v)
        args.conversations, args.turn_tokens = min(args.conversations, 8), 8

    import parallel_models as pm
    from parallel_models.rl.agents.async_turns import REENTRY_WAIT_STEPS
    from parallel_models.rl.agents.tool_call_format import TOOL_CALL_FORMATS
    from parallel_models.tokenizer import build_builtin_tokenizer

    if args.reentry_wait_steps is None:
        args.reentry_wait_steps = REENTRY_WAIT_STEPS
    TOOL_CALL_FORMATS.register("bench_every_turn")(every_turn_calls_wait)
    pm.init_parallel()
    tok = build_builtin_tokenizer(model_max_length=1 << 16)
    args.vocab = len(tok)  # the generated ids are the tokenizer's
    model = build_random_llama(args, pm.LlamaForCausalLMRmPad, seed=0)
    g = torch.Generator().manual_seed(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    prompts = []
    for _ in range(args.conversations):
        n = int(torch.randint(64, 193, (1,), generator=g))
        text = "".join(letters[int(i)] for i in torch.randint(0, len(letters), (n,),
                                                               generator=g))
        prompts.append(tok(text)["input_ids"])
    latency = args.latency_ms / 1e3
    cases = {"no_latency": run_case(model, tok, prompts, args, 0.0, True),
             "no_latency_turn_synchronous": run_case(model, tok, prompts, args, 0.0, False)}
    cases["tools"] = run_case(model, tok, prompts, args, latency, True)
    if not args.skip_sync:
        cases["tools_turn_synchronous"] = run_case(model, tok, prompts, args, latency, False)
    default_wait = args.reentry_wait_steps
    for wait_steps in args.sweep_wait_steps:
        if wait_steps != default_wait:
            args.reentry_wait_steps = wait_steps
            cases[f"tools_wait{wait_steps}"] = run_case(model, tok, prompts, args, latency, True)
    args.reentry_wait_steps = default_wait
    if args.compare_prefilled_reentries:
        feed, args.decode_extension_tokens = args.decode_extension_tokens, 0
        cases["tools_prefilled_reentries"] = run_case(model, tok, prompts, args, latency, True)
        args.decode_extension_tokens = feed
    streams = [c.pop("_streams") for c in cases.values()]
    work = [c.pop("_work") for c in cases.values()]
    baseline = max((n for n in cases if n.startswith("no_latency")),
                   key=lambda n: cases[n]["tokens_per_s"])
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "args": vars(args),
           "cases": cases, "same_work": all(w == work[0] for w in work),
           "same_tokens": all(s == streams[0] for s in streams), "baseline": baseline,
           "throughput_ratio": round(cases["tools"]["tokens_per_s"] /
                                     cases[baseline]["tokens_per_s"], 3),
           "throughput_ratio_worst": round(cases[baseline]["seconds_min"] /
                                           cases["tools"]["seconds_max"], 3),
           "target": 0.8}
    if args.sweep_wait_steps:
        res["ratio_by_wait_steps"] = {
            w: round(cases["tools" if w == default_wait else f"tools_wait{w}"]["tokens_per_s"] /
                     cases[baseline]["tokens_per_s"], 3) for w in args.sweep_wait_steps}
    report(res, args.out)


if __name__ == "__main__":
    main()
