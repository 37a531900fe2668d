"""The weight stream's wire format (server/weight_stream.py) in one process: frames cut at any
chunk boundary parse back to the same tensors bit for bit; a stream without its end frame, with
a wrong tensor count, or with garbage is refused."""

import random

import pytest
import torch

from parallel_models.rl.rollout.server.weight_stream import (StreamParser, WeightStreamError,
                                                             bucket_frame, end_frame)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(7, 5, generator=g),
            "b.weight": torch.randn(3, generator=g).to(torch.bfloat16),
            "c.weight": torch.randn(2, 2, 2, generator=g, dtype=torch.float64)}


def _body(tensors, end=True):
    out = b""
    for name, t in tensors.items():  # one bucket per tensor (a bucket holds one dtype)
        header, payload = bucket_frame({name: t})
        out += header + bytes(payload)
    return out + (end_frame(len(tensors)) if end else b"")


@pytest.mark.parametrize("seed", range(5))
def test_any_chunking_parses_bit_exact(seed):
    tensors = _tensors()
    body = _body(tensors)
    rng = random.Random(seed)
    parser, pos = StreamParser(), 0
    while pos < len(body):
        step = rng.choice([1, 3, 8, 17, 100, 4096])
        parser.feed(body[pos:pos + step])
        pos += step
    got = parser.finish()
    assert got.keys() == tensors.keys()
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


@pytest.mark.parametrize("body,message", [
    (lambda t: _body(t, end=False), "cut short"),
    (lambda t: _body(t, end=False)[:-5], "cut short"),
    (lambda t: _body(t, end=False) + end_frame(9), "end frame says 9"),
    (lambda t: b"\xff" * 64, "not a weight stream"),
])
def test_bad_streams_are_refused(body, message):
    parser = StreamParser()
    with pytest.raises(WeightStreamError, match=message):
        parser.feed(body(_tensors()))
        parser.finish()
