"""The weight stream's wire format (server/weight_stream.py) in one process: frames cut at any
chunk boundary parse back to the same tensors bit for bit; a stream without its end frame, with
a wrong tensor count, or with garbage is refused."""

import random

import pytest
import torch

from parallel_models.inference.server.weight_stream import (StreamParser, WeightStreamError,
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


def test_client_sends_a_big_bucket_in_small_zero_copy_pieces():
    """httpcore copies the unsent rest of a chunk after every socket send (quadratic in the chunk
    size): the client must hand httpx pieces of at most WIRE_PIECE_BYTES, views of the bucket's
    host buffer (no copy), which still parse back bit for bit."""
    import httpx

    from parallel_models.inference.server.client import WIRE_PIECE_BYTES, RolloutClient

    big = {"w.weight": torch.arange(3 * WIRE_PIECE_BYTES // 4 + 5, dtype=torch.float32)}
    header, payload = bucket_frame(big)
    base = torch.frombuffer(payload, dtype=torch.uint8).data_ptr()
    sizes, shared, parser = [], [], StreamParser()

    class Wire(httpx.BaseTransport):  # sees the pieces as they would go to the socket
        def handle_request(self, request):
            for piece in request.stream:
                sizes.append(len(piece))
                ptr = torch.frombuffer(piece, dtype=torch.uint8).data_ptr() if len(piece) else 0
                shared.append(base <= ptr < base + len(payload))
                parser.feed(piece)
            return httpx.Response(200, json={"weight_version": 1})

    client = RolloutClient("http://server")
    client._http = httpx.Client(base_url="http://server", transport=Wire())
    assert client.push_weight_stream([header, payload, end_frame(1)]) == {"weight_version": 1}
    assert max(sizes) <= WIRE_PIECE_BYTES and sum(sizes) == len(header) + len(payload) + len(
        end_frame(1))
    assert sum(shared) >= 3  # the payload's pieces point into its buffer: nothing was copied
    assert torch.equal(parser.finish()["w.weight"], big["w.weight"])
