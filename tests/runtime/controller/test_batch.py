"""The batch protocol: fields, chunk/concat, pad/unpad, select/union, repeat-interleave, Ray round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.runtime.controller.batch import Batch
from hybridflow.simulator.errors import HflowError


def make(n: int = 5) -> Batch:
    g = torch.Generator().manual_seed(n)
    return Batch({"ids": torch.arange(n * 3).view(n, 3), "logp": torch.randn(n, generator=g)},
                 non_tensors={"prompt": [f"p{i}" for i in range(n)], "answer": [[i, i + 1] for i in range(n)]},
                 meta={"temperature": 0.7})


def test_fields_and_indexing():
    b = make()
    assert len(b) == 5 and set(b.keys()) == {"ids", "logp", "prompt", "answer"}
    assert b["prompt"][2] == "p2" and b["answer"][1] == [1, 2]  # lists stay per-sample objects
    sub = b[[4, 0]]
    assert sub["prompt"].tolist() == ["p4", "p0"] and torch.equal(sub["ids"], b["ids"][[4, 0]])
    assert b[-1]["prompt"].tolist() == ["p4"] and len(b[1:3]) == 2
    b["values"] = torch.ones(5)
    b["tag"] = list("abcde")
    assert "values" in b and b["tag"][3] == "d"
    with pytest.raises(HflowError, match="has 2 samples but the batch has 5"):
        b["bad"] = torch.ones(2)
    with pytest.raises(KeyError, match="no field 'nope'"):
        b["nope"]


def test_fields_must_agree_on_size():
    with pytest.raises(HflowError, match="disagree on the number of samples"):
        Batch({"a": torch.ones(3)}, non_tensors={"p": ["x", "y"]})


@pytest.mark.parametrize("n,parts", [(8, 4), (5, 4), (7, 3), (1, 4), (6, 6)])
def test_pad_chunk_concat_unpad_round_trip(n, parts):
    b = make(n)
    padded, pad = b.pad_to_multiple(parts)
    assert len(padded) % parts == 0 and pad == -n % parts
    chunks = padded.chunk(parts)
    assert len(chunks) == parts and {len(c) for c in chunks} == {len(padded) // parts}
    back = Batch.concat(chunks).unpad(pad)
    assert back.equals(b)


def test_chunk_refuses_uneven_split():
    with pytest.raises(HflowError, match=r"pad_to_multiple\(2\)"):
        make(5).chunk(2)


def test_select_union_repeat_interleave():
    b = make(4)
    s = b.select("ids", "prompt")
    assert set(s.keys()) == {"ids", "prompt"} and s.meta == b.meta
    extra = Batch({"values": torch.arange(4.0)}, meta={"step": 3})
    u = s.union(extra)
    assert set(u.keys()) == {"ids", "prompt", "values"} and u.meta == {"temperature": 0.7, "step": 3}
    with pytest.raises(HflowError, match="field 'ids' differs"):
        s.union(Batch({"ids": torch.zeros(4, 3, dtype=torch.long)}))
    r = b.repeat_interleave(3)
    assert len(r) == 12 and r["prompt"][:4].tolist() == ["p0", "p0", "p0", "p1"]
    assert torch.equal(r["ids"][3], b["ids"][1])


def test_concat_needs_same_fields():
    with pytest.raises(HflowError, match="different fields"):
        Batch.concat([make(2), make(2).select("ids")])


def test_object_array_of_equal_length_lists_stays_one_dimensional():
    b = Batch(non_tensors={"pairs": [[1, 2], [3, 4]]})
    assert b["pairs"].shape == (2,) and isinstance(b["pairs"][0], list)
    assert np.array_equal(Batch.concat([b, b])["pairs"][2], [1, 2])


def test_round_trip_through_ray_object_store(ray_local):
    b = make(6)
    assert ray_local.get(ray_local.put(b)).equals(b)
