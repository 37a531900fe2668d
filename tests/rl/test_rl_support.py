"""The PPO support modules: prompt data, built-in tokenizer, rule rewards, metrics.

Fast, single process, no model: every test here runs on CPU in well under a second or two.
"""

import json
import os
import random
import string

import pytest

from parallel_models.config import ConfigError
from parallel_models.rl.config import PPOConfig
from parallel_models.rl.data.prompts import DataError, PromptDataset, PromptLoader, builtin_prompts
from parallel_models.rl.observe.metrics import MetricsLogger, Timer, read_metrics
from parallel_models.rl.observe.plots import plot_reward_curve
from parallel_models.rl.rewards.rules import (exact_match, length_reward, load_reward_function,
                                        vowel_reward)
from parallel_models.tokenizer import build_builtin_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_builtin_tokenizer()


# ================================ tokenizer ======================================================
def test_tokenizer_round_trip(tok):
    assert len(tok) == 74
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "hello, world! 123\nok?  (a+b)=c; 'x' \"y\" ~_|"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert len(ids) == len(text) + 1                   # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids[1:]) == text
    assert tok("Héllo")["input_ids"] == tok("hello")["input_ids"]
    assert tok("\u20ac")["input_ids"] == [tok.bos_token_id, tok.unk_token_id]
    assert tok.decode(tok("ab", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                      skip_special_tokens=True) == "ab"


def test_tokenizer_save_reload_and_chat_template(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path / "tok")
    again = AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = "say something happy: yay!"
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (0, 1, 2)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "more"}]
    rendered = again.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == "<s>user: hi\nassistant: yo</s>\nuser: more\nassistant: "
    assert rendered == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert again.decode(again(rendered, add_special_tokens=False)["input_ids"]) == rendered


# ================================ data ===========================================================
def write_jsonl(path, records, raw_lines=()):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return str(path)


def test_jsonl_prompts_and_messages(tok, tmp_path):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a color"}]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "count to five:", "id": 1},
                                              {"messages": msgs, "id": 2}])
    with open(path, "a") as f:
        f.write("\n")                                  # blank lines are skipped
    ds = PromptDataset(path, tok, max_prompt_length=64)
    assert len(ds) == 2
    assert ds[0]["input_ids"] == tok("count to five:")["input_ids"]     # BOS + text
    assert ds[0]["input_ids"][0] == tok.bos_token_id
    assert tok.decode(ds[1]["input_ids"]) == \
        "<s>system: be brief\nuser: name a color\nassistant: "
    assert ds[1]["record"]["id"] == 2
    # plain prompts in the chat template on request
    ds2 = PromptDataset(path, tok, chat_template=True)
    assert tok.decode(ds2[0]["input_ids"]) == "<s>user: count to five:\nassistant: "
    # other key names
    path2 = write_jsonl(tmp_path / "q.jsonl", [{"question": "why?"}])
    assert PromptDataset(path2, tok, prompt_key="question")[0]["input_ids"] == \
        tok("why?")["input_ids"]


def test_parquet_and_json(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "say hello:", "messages": None},
            {"prompt": None, "messages": [{"role": "user", "content": "hi"}]},
            {"prompt": "name a fruit:", "messages": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    ds = PromptDataset(tmp_path / "p.parquet", tok)
    assert len(ds) == 3
    assert ds[0]["input_ids"] == tok("say hello:")["input_ids"]
    assert tok.decode(ds[1]["input_ids"]) == "<s>user: hi\nassistant: "
    assert ds[2]["record"]["prompt"] == "name a fruit:"

    (tmp_path / "p.json").write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}]))
    assert [x["input_ids"] for x in (PromptDataset(tmp_path / "p.json", tok)[i]
                                     for i in range(2))] == \
        [tok("a")["input_ids"], tok("b")["input_ids"]]

    pq.write_table(pa.Table.from_pylist([{"text": "x"}]), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet row 0.*neither 'prompt' nor 'messages'"):
        PromptDataset(tmp_path / "bad.parquet", tok)


def test_data_errors(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        PromptDataset(tmp_path / "nope.jsonl", tok)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}], raw_lines=['{"prompt": "x",'])
    with pytest.raises(DataError, match=r"bad.jsonl:2: invalid JSON"):
        PromptDataset(bad, tok)
    nokey = write_jsonl(tmp_path / "nokey.jsonl", [{"prompt": "ok"}, {"text": "x", "id": 3}])
    with pytest.raises(DataError) as e:
        PromptDataset(nokey, tok)
    msg = str(e.value)
    assert "nokey.jsonl:2" in msg and "'prompt'" in msg and "'messages'" in msg
    assert "['id', 'text']" in msg                     # the keys the record does have
    notobj = write_jsonl(tmp_path / "list.jsonl", [], raw_lines=["[1, 2]"])
    with pytest.raises(DataError, match=r"list.jsonl:1: expected a JSON object"):
        PromptDataset(notobj, tok)
    badmsg = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(DataError, match=r"m.jsonl:1: messages\[0\]"):
        PromptDataset(badmsg, tok)
    notstr = write_jsonl(tmp_path / "n.jsonl", [{"prompt": 5}])
    with pytest.raises(DataError, match=r"n.jsonl:1: 'prompt' must be a string"):
        PromptDataset(notstr, tok)
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match="no prompt records"):
        PromptDataset(empty, tok)
    (tmp_path / "p.csv").write_text("prompt\nx\n")
    with pytest.raises(DataError, match="unsupported"):
        PromptDataset(tmp_path / "p.csv", tok)
    assert issubclass(DataError, ConfigError)          # the entrypoint reports it and exits 2


def test_truncation_policies(tok, tmp_path):
    long_text = "abcdefghijklmnopqrstuvwxyz0123456789"
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": long_text}, {"prompt": "short"},
                                              {"prompt": long_text[::-1]}])
    ds = PromptDataset(path, tok, max_prompt_length=10, truncation="left")
    full = tok(long_text)["input_ids"]
    assert ds[0]["input_ids"] == [tok.bos_token_id] + full[-9:]   # BOS kept, end kept
    assert tok.decode(ds[0]["input_ids"], skip_special_tokens=True) == long_text[-9:]
    assert ds[1]["input_ids"] == tok("short")["input_ids"]
    assert ds.num_truncated == 2 and ds.num_dropped == 0 and len(ds) == 3
    assert max(len(ds[i]["input_ids"]) for i in range(3)) == 10

    dropped = PromptDataset(path, tok, max_prompt_length=10, truncation="drop")
    assert len(dropped) == 1 and dropped.num_dropped == 2
    assert dropped[0]["record"] == {"prompt": "short"}
    with pytest.raises(DataError, match=r"p.jsonl:1: prompt has 37 tokens"):
        PromptDataset(path, tok, max_prompt_length=10, truncation="error")
    with pytest.raises(DataError, match="all 3 prompts"):
        PromptDataset(path, tok, max_prompt_length=2, truncation="drop")


def test_builtin_prompts(tok):
    prompts = builtin_prompts()
    assert len(prompts) == 64 and len({p["prompt"] for p in prompts}) == 64
    ds = PromptDataset(None, tok, max_prompt_length=64)
    assert len(ds) == 64 and ds.num_truncated == 0
    assert all(tok.unk_token_id not in ds[i]["input_ids"] for i in range(len(ds)))


def _indices(loader, n):
    return [loader.next_batch()["indices"] for _ in range(n)]


def test_loader_determinism_and_epochs(tok):
    ds = PromptDataset(None, tok)
    a, b = PromptLoader(ds, 8, seed=3), PromptLoader(ds, 8, seed=3)
    ia, ib = _indices(a, 16), _indices(b, 16)
    assert ia == ib
    assert _indices(PromptLoader(ds, 8, seed=4), 16) != ia
    epoch0 = [i for batch in ia[:8] for i in batch]
    epoch1 = [i for batch in ia[8:] for i in batch]
    assert sorted(epoch0) == list(range(64)) == sorted(epoch1)   # each epoch sees every prompt
    assert epoch0 != epoch1                                       # and is reshuffled
    assert epoch0 != list(range(64))
    batch = PromptLoader(ds, 8, seed=3).next_batch()
    assert batch["input_ids"] == [ds[i]["input_ids"] for i in batch["indices"]]
    assert batch["records"] == [ds[i]["record"] for i in batch["indices"]]
    # no shuffle: identity order
    assert _indices(PromptLoader(ds, 8, shuffle=False), 1) == [list(range(8))]
    # batches crossing the end of an epoch keep their size and complete from the next epoch
    small = PromptDataset(None, tok, records=[{"prompt": c} for c in "abcdefghij"])
    ld = PromptLoader(small, 4, seed=0)
    got = _indices(ld, 5)
    assert all(len(x) == 4 for x in got)
    flat = [i for x in got for i in x]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert ld.state_dict()["epoch"] == 2 and ld.state_dict()["position"] == 0


def test_loader_resume_continues_exactly(tok):
    ds = PromptDataset(None, tok, records=[{"prompt": f"p{i}"} for i in range(13)])
    straight = PromptLoader(ds, 5, seed=11)
    expected = _indices(straight, 9)
    first = PromptLoader(ds, 5, seed=11)
    got = _indices(first, 4)
    state = json.loads(json.dumps(first.state_dict()))   # as saved in trainer_state.json
    resumed = PromptLoader(ds, 5, seed=11)
    resumed.load_state_dict(state)
    got += _indices(resumed, 5)
    assert got == expected
    with pytest.raises(ValueError, match="seed"):
        PromptLoader(ds, 5, seed=12).load_state_dict(state)
    other = PromptDataset(None, tok, records=[{"prompt": f"p{i}"} for i in range(14)])
    with pytest.raises(ValueError, match="dataset_size"):
        PromptLoader(other, 5, seed=11).load_state_dict(state)


# ================================ rewards ========================================================
def test_reward_loading(tmp_path):
    from parallel_models.rl.config.sections import reward_function_path
    from parallel_models.rl.data.tasks import first_number_match

    assert load_reward_function(reward_function_path(PPOConfig())) is vowel_reward
    task_cfg = PPOConfig.from_dict({"data": {"task": "last_digit"}})
    assert load_reward_function(reward_function_path(task_cfg)) is first_number_match
    assert load_reward_function("parallel_models.rl.rewards.rules:length_reward") is length_reward
    with pytest.raises(ConfigError, match="module 'no_such_pkg.mod' not found"):
        load_reward_function("no_such_pkg.mod.fn")
    with pytest.raises(ConfigError) as e:
        load_reward_function("parallel_models.rl.rewards.rules.no_such_fn")
    assert "no attribute 'no_such_fn'" in str(e.value) and "vowel_reward" in str(e.value)
    with pytest.raises(ConfigError, match="'VOWELS'.*not callable"):
        load_reward_function("parallel_models.rl.rewards.rules.VOWELS")
    assert load_reward_function("vowel_reward") is vowel_reward  # a registered name
    with pytest.raises(ConfigError, match="dotted path.*did you mean 'vowel_reward'"):
        load_reward_function("vowel_rewrd")
    f = tmp_path / "myreward.py"
    f.write_text("def score(prompts, responses, **kw):\n    return [1.0] * len(responses)\n")
    assert load_reward_function(f"{f}:score")(["p"], ["r"]) == [1.0]
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ConfigError, match="no_such_dependency_xyz"):
        load_reward_function(f"{broken}:score")
    with pytest.raises(ConfigError, match="not found"):
        load_reward_function(f"{tmp_path / 'absent.py'}:score")


def test_default_reward_separates_target_heavy_from_random():
    rng = random.Random(0)
    alphabet = string.ascii_lowercase + string.digits + " " + string.punctuation
    randoms = ["".join(rng.choice(alphabet) for _ in range(16)) for _ in range(200)]
    heavy = ["aeiouaoeiuaeioua", "oooooooooooooooo", "hello aeiou aeia"]
    r_rand = vowel_reward([""] * len(randoms), randoms)
    r_heavy = vowel_reward([""] * 3, heavy)
    mean_rand = sum(r_rand) / len(r_rand)
    assert mean_rand < 0.15
    assert min(r_heavy) > 0.5 > mean_rand + 0.3
    assert r_heavy[:2] == [1.0, 1.0]
    # changing one character changes the score by about 1/length: dense, per-token credit
    base, better = vowel_reward([""] * 2, ["xxxxxxxx", "xxxxxxxa"])
    assert better - base == pytest.approx(1 / 8)
    # empty / very short answers are penalized below any full-length answer
    empty, short, full = vowel_reward([""] * 3, ["", "a", "xxxx"])
    assert empty == -0.5 and empty < short < 1.0 and full == 0.0 and empty < full


def test_length_and_exact_match():
    assert length_reward([""] * 3, ["x" * 8, "x" * 4, ""], target_length=8) == [1.0, 0.5, 0.0]
    assert exact_match(["q", "q"], [" Paris ", "rome"], answers=["paris", "paris"]) == [1.0, 0.0]
    assert exact_match(["q"], ["4"], records=[{"answer": 4}]) == [1.0]
    with pytest.raises(ValueError, match="answers"):
        exact_match(["q"], ["4"])
    with pytest.raises(ValueError, match="'answer'"):
        exact_match(["q"], ["4"], records=[{"label": 4}])


# ================================ metrics ========================================================
def _scalars(tb_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_metrics_jsonl_tensorboard_and_plot(tmp_path):
    import torch

    with MetricsLogger(tmp_path, tensorboard=True) as ml:
        for step in range(1, 7):
            ml.log(step, {"reward/mean": 0.1 * step, "loss": torch.tensor(2.0 / step),
                          "flag": True, "name": "skip-me", "count": 3})
        # flushed every step: readable before close
        assert len(read_metrics(tmp_path / "metrics.jsonl")) == 6
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[2] == {"step": 3, "reward/mean": pytest.approx(0.3), "loss": pytest.approx(2 / 3),
                       "flag": 1.0, "count": 3.0}
    assert all(isinstance(v, float) for r in rows for k, v in r.items() if k != "step")
    events = [f for f in os.listdir(tmp_path / "tensorboard") if "tfevents" in f]
    assert events and os.path.getsize(tmp_path / "tensorboard" / events[0]) > 0
    got = _scalars(tmp_path / "tensorboard", "reward/mean")
    assert [s for s, _ in got] == [1, 2, 3, 4, 5, 6]
    assert got[-1][1] == pytest.approx(0.6)

    png = plot_reward_curve(tmp_path / "metrics.jsonl", tmp_path / "plots" / "reward.png")
    with open(png, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 5000
    with pytest.raises(ValueError, match="no 'kl' values.*reward/mean"):
        plot_reward_curve(tmp_path / "metrics.jsonl", tmp_path / "x.png", key="kl")


def test_metrics_resume_truncates_later_steps(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=True) as ml:
        for step in range(1, 7):
            ml.log(step, {"reward/mean": float(step)})
    # resume from the checkpoint of step 3: steps 4..6 are written again
    with MetricsLogger(tmp_path, tensorboard=True) as ml:
        assert ml.truncate_after(3) == 3
        assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
        for step in range(4, 8):
            ml.log(step, {"reward/mean": 10.0 * step})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["reward/mean"] for r in rows] == [1, 2, 3, 40, 50, 60, 70]
    got = _scalars(tmp_path / "tensorboard", "reward/mean")   # old 4..6 purged
    assert [s for s, _ in got] == [1, 2, 3, 4, 5, 6, 7]
    assert [v for _, v in got] == [1, 2, 3, 40, 50, 60, 70]
    # the same through the constructor
    MetricsLogger(tmp_path, tensorboard=False, resume_step=5).close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    # a fresh run over an old folder does not duplicate steps either (even without truncate)
    with MetricsLogger(tmp_path, tensorboard=False) as ml:
        ml.log(1, {"reward/mean": -1.0})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "reward/mean": -1.0}]


def test_metrics_only_rank0_writes(tmp_path, monkeypatch):
    import parallel_models.rl.observe.metrics as metrics_mod

    monkeypatch.setattr(metrics_mod, "_global_rank", lambda: 1)
    with MetricsLogger(tmp_path / "out", tensorboard=True) as ml:
        assert ml.log(1, {"a": 1.0}) == {"a": 1.0}
        ml.truncate_after(0)
    assert not os.path.exists(tmp_path / "out")


def test_timer_records_phase_seconds():
    import time

    timings, memory = {}, {}
    with Timer("gen", timings, memory) as t:
        time.sleep(0.02)
    with Timer("gen", timings, memory) as t2:   # a repeated phase adds up
        time.sleep(0.01)
    with Timer("train", timings):
        pass
    assert t.seconds >= 0.02 and t2.seconds >= 0.01
    assert timings["gen"] == pytest.approx(t.seconds + t2.seconds)
    assert set(timings) == {"gen", "train"} and timings["train"] < 0.01
    import torch

    if torch.cuda.is_available():
        assert memory["gen_peak_gib"] >= 0.0
    else:
        assert memory == {} and t.peak_memory_gib is None


def test_timer_records_peaks_reserved_memory_and_allocator_retries(monkeypatch):
    """A phase's peak allocated / reserved GiB and its allocator retries (the counter's change
    over the phase); a repeated phase keeps the maxima and adds the retries."""
    import torch

    gib = 2 ** 30
    state = {"allocated": 0, "reserved": 0, "retries": 7}
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(cuda, "memory_stats",
                        lambda device=None: {"num_alloc_retries": state["retries"]})
    memory = {}
    with Timer("train_actor", {}, memory) as t:
        state.update(allocated=50 * gib, reserved=70 * gib, retries=10)
    assert t.peak_memory_gib == 50.0
    assert memory == {"train_actor_peak_gib": 50.0, "train_actor_reserved_gib": 70.0,
                      "train_actor_alloc_retries": 3}
    with Timer("train_actor", {}, memory):
        state.update(allocated=40 * gib, reserved=75 * gib, retries=12)
    assert memory == {"train_actor_peak_gib": 50.0, "train_actor_reserved_gib": 75.0,
                      "train_actor_alloc_retries": 5}
