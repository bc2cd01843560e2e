import json

import pytest

from hybridflow.simulator import Event, HflowError, Timeline
from hybridflow.simulator.schedule.export import (
    OP_COLORS,
    chrome_trace,
    gantt_png,
    lane_order,
    write_chrome_trace,
    write_gantt_png,
)
from hybridflow.simulator.vocabulary.timeline import OPS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def timeline(source="simulated"):
    ev = [
        Event(op="reshard", role="actor", group="train+rollout", start=0.0, end=0.5, bytes=1e9),
        Event(op="generate", role="actor", group="rollout", start=0.5, end=3.0, flops=1e15,
              breakdown={"memory": 2.0, "compute": 0.5}),
        Event(op="values", role="critic", group="train", start=3.0, end=4.0),
        Event(op="advantage", role="driver", group="driver", start=4.0, end=4.1),
        Event(op="actor_update", role="actor", group="train", start=4.1, end=6.1, iteration=0),
        Event(op="generate", role="actor", group="rollout", start=6.1, end=8.0, iteration=1),
    ]
    return Timeline(source=source, events=ev, tokens_per_iteration=1000,
                    meta={"lanes": {"train": "8 devices (node0:0-7)", "rollout": "8 devices (node1:0-7)"},
                          "algorithm": "ppo"})


def test_every_shared_op_has_its_own_colour():
    assert set(OP_COLORS) == set(OPS) and len(set(OP_COLORS.values())) == len(OPS)


def test_lanes_in_order_of_first_use_driver_last():
    assert lane_order(timeline()) == ["train", "rollout", "driver"]


def test_chrome_trace_has_one_thread_per_group_and_microsecond_events():
    tr = chrome_trace(timeline())
    json.dumps(tr)  # serialisable
    names = {e["tid"]: e["args"]["name"] for e in tr["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(names.values()) == ["driver", "rollout — 8 devices (node1:0-7)", "train — 8 devices (node0:0-7)"]
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 7  # the broadcast appears on both of its groups
    gen = next(e for e in xs if e["name"] == "generate" and e["args"]["iteration"] == 0)
    assert gen["ts"] == pytest.approx(0.5e6) and gen["dur"] == pytest.approx(2.5e6)
    assert gen["args"]["breakdown.memory"] == 2.0 and gen["args"]["flops"] == 1e15
    assert {e["tid"] for e in xs if e["name"] == "reshard"} == {
        t for t, n in names.items() if n.split(" ")[0] in ("train", "rollout")}
    assert tr["otherData"]["source"] == "simulated"


def test_chrome_trace_file_is_valid_json(tmp_path):
    p = write_chrome_trace(timeline("measured"), tmp_path / "t.json")
    data = json.loads(p.read_text())
    assert data["otherData"]["source"] == "measured" and data["displayTimeUnit"] == "ms"


def test_gantt_png_is_a_picture_with_a_row_per_group(tmp_path):
    png = gantt_png(timeline())
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    p = write_gantt_png(timeline(), tmp_path / "g.png")
    assert p.read_bytes().startswith(PNG_MAGIC)
    # more lanes, taller picture: the rows are really drawn per group
    import struct

    height = struct.unpack(">I", png[20:24])[0]
    one = Timeline(source="simulated", events=[Event(op="generate", role="actor", group="g", start=0, end=1)])
    assert struct.unpack(">I", gantt_png(one)[20:24])[0] < height


def test_gantt_refuses_other_suffixes_and_empty_timelines(tmp_path):
    with pytest.raises(HflowError, match="PNG"):
        write_gantt_png(timeline(), tmp_path / "g.svg")
    assert not (tmp_path / "g.svg").exists()
    with pytest.raises(HflowError, match="no events"):
        gantt_png(Timeline(source="measured"))
