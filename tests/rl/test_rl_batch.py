"""RolloutBatch: the mapping view roles read, row selection, minibatches per epoch and data-parallel
rank, concatenation with re-padding, and clear errors for missing or misshapen fields."""

import pytest
import torch

from parallel_models.rl.data.batch import RolloutBatch


def make_batch(n_prompts=4, n=2, prompt=3, resp=4, seed=0, messages=True):
    g = torch.Generator().manual_seed(seed)
    rows = n_prompts * n
    seq = torch.randint(1, 50, (rows, prompt + resp), generator=g)
    am = torch.ones(rows, prompt + resp, dtype=torch.long)
    am[::3, 0] = 0  # some left padding
    rmask = torch.ones(rows, resp, dtype=torch.long)
    for i in range(rows):
        rmask[i, 1 + i % resp:] = 0
    am[:, prompt:] = rmask
    cols = {"messages": [f"m{i}" for i in range(rows)]} if messages else {}
    return RolloutBatch(sequences=seq, attention_mask=am, prompt_lengths=am[:, :prompt].sum(-1),
                        response_mask=rmask,
                        group_index=torch.arange(n_prompts).repeat_interleave(n),
                        scores=torch.randn(rows, generator=g),
                        old_log_probs=torch.randn(rows, resp, generator=g), columns=cols)


def test_mapping_view_and_missing_field_message():
    b = make_batch()
    assert b["sequences"] is b.sequences and b.get("messages")[1] == "m1"
    assert "old_log_probs" in b and "values" not in b and b.get("values") is None
    with pytest.raises(KeyError, match="values.*critic"):
        b["values"]
    b["values"] = torch.zeros(len(b), b.response_length)
    assert "values" in b
    with pytest.raises(ValueError, match="values has shape"):
        b["values"] = torch.zeros(len(b), b.response_length + 1)


def test_shape_and_column_checks():
    b = make_batch()
    with pytest.raises(ValueError, match="returns has shape"):
        RolloutBatch(**dict(b.tensor_items()), returns=torch.zeros(len(b), 2))
    with pytest.raises(ValueError, match="column 'messages' has 3 entries"):
        RolloutBatch(**dict(b.tensor_items()), columns={"messages": [1, 2, 3]})
    with pytest.raises(ValueError, match="no tensor field 'advantage'"):
        RolloutBatch.from_dict({**dict(b.tensor_items()), "advantage": torch.zeros(len(b))})


def test_select_keeps_rows_and_columns():
    b = make_batch()
    s = b.select([5, 0, 2])
    assert torch.equal(s.sequences, b.sequences[[5, 0, 2]])
    assert torch.equal(s.old_log_probs, b.old_log_probs[[5, 0, 2]])
    assert s.columns["messages"] == ["m5", "m0", "m2"]


@pytest.mark.parametrize("dp", [1, 2])
def test_minibatches_cover_every_row_once_per_epoch(dp):
    b = make_batch(n_prompts=8)
    mbs = b.minibatches(mini_batch_size=8, data_parallel_size=dp, seed=3)
    assert [len(m) for m in mbs] == [8 // dp] * (16 // (8 // dp))
    seen = sorted(int(x[1:]) for m in mbs for x in m.columns["messages"])
    assert seen == list(range(16))
    again = b.minibatches(8, dp, seed=3)
    assert all(torch.equal(x.sequences, y.sequences) for x, y in zip(mbs, again))
    other = b.minibatches(8, dp, seed=4)
    assert not all(torch.equal(x.sequences, y.sequences) for x, y in zip(mbs, other))
    with pytest.raises(ValueError, match="mini_batch_size"):
        b.minibatches(3, 2, seed=0)


def test_data_parallel_share_keeps_groups_whole():
    b = make_batch(n_prompts=5, n=3)
    shares = [b.data_parallel_share(r, 2) for r in range(2)]
    assert [len(s) for s in shares] == [9, 6]
    for s in shares:
        assert not set(s.group_index.tolist()) & set(
            (shares[1] if s is shares[0] else shares[0]).group_index.tolist())
    assert sorted(shares[0].group_index.unique().tolist()) == [0, 2, 4]  # round-robin, like
    assert torch.equal(b.data_parallel_share(0, 1).sequences, b.sequences)  # the trainer's deal


def test_concat_repads_and_separates_groups():
    a = make_batch(n_prompts=2, prompt=3, resp=4, seed=1)
    b = make_batch(n_prompts=1, prompt=5, resp=2, seed=2)
    c = RolloutBatch.concat([a, b])
    assert len(c) == len(a) + len(b) and c.sequences.shape == (6, 5 + 4)
    assert c.response_length == 4
    # a's rows: prompts left-padded by 2, responses unchanged
    assert torch.equal(c.sequences[:4, 2:], a.sequences) and (c.attention_mask[:4, :2] == 0).all()
    # b's rows: responses right-padded by 2, per-token fields too
    assert torch.equal(c.sequences[4:, :7], b.sequences)
    assert (c.response_mask[4:, 2:] == 0).all() and (c.old_log_probs[4:, 2:] == 0).all()
    assert torch.equal(c.response_mask[4:, :2], b.response_mask)
    assert c.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert c.columns["messages"] == a.columns["messages"] + b.columns["messages"]
    # the prompt lengths still locate each response: sequences[prompt width:] is the response
    assert torch.equal(c.sequences[:, 5:][c.response_mask.bool()],
                       torch.cat([a.sequences[:, 3:][a.response_mask.bool()],
                                  b.sequences[:, 5:][b.response_mask.bool()]]))
    with pytest.raises(ValueError, match="different fields"):
        RolloutBatch.concat([a, make_batch(messages=False)])
