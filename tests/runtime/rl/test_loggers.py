"""Metrics loggers, each read back through its own format: TensorBoard's event file, the W&B offline run's
record log, MLflow's file store. A logger whose library is not installed skips with the reason."""

import json
import struct
import time

import pytest

from hybridflow.runtime.rl.loggers import open_loggers, parse_logger_names, scalars
from hybridflow.simulator.errors import HflowError

SAMPLES = [{"prompt": [{"role": "user", "content": "what is 2 plus 3?"}], "response": "5 | five", "reward": 1.0}]
ITERATIONS = [
    {"iteration": 1, "reward_mean": 0.25, "op_seconds": {"generate": 0.5}, "samples": SAMPLES, "actor/step": 1},
    {"iteration": 2, "reward_mean": 0.75, "op_seconds": {"generate": 0.4}, "actor/step": 2},
]
PARAMS = {"algorithm": "grpo", "actor_lr": 2e-4}


def _log_all(names, **kw):
    loggers = open_loggers(names, run_name="test-run", params=PARAMS, **kw)
    for m in ITERATIONS:
        for lg in loggers:
            lg.log(m)
    for lg in loggers:
        lg.close()


def test_logger_names_are_checked_before_anything_starts():
    assert parse_logger_names(None) == []
    with pytest.raises(HflowError, match="unknown logger 'neptune'; choose from tensorboard, wandb, mlflow"):
        parse_logger_names("tensorboard,neptune")
    assert scalars(ITERATIONS[0]) == {"reward_mean": 0.25, "op_seconds/generate": 0.5, "actor/step": 1.0}


def test_tensorboard_event_file_reads_back(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard logger needs tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert parse_logger_names("tensorboard, tensorboard") == ["tensorboard"]
    _log_all(["tensorboard"], tensorboard_dir=str(tmp_path))
    ea = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    ea.Reload()
    assert [(s.step, s.value) for s in ea.Scalars("reward_mean")] == [(1, 0.25), (2, 0.75)]
    assert [s.step for s in ea.Scalars("op_seconds/generate")] == [1, 2]
    text = ea.Tensors("samples/text_summary")[0]
    assert text.step == 1 and b"5 \\| five" in text.tensor_proto.string_val[0]


def _wandb_records(path):
    """The records of a W&B `.wandb` file: a 7-byte header, then LevelDB-log chunks in 32 KiB blocks
    (crc32, length, type; FULL = 1, FIRST = 2, MIDDLE = 3, LAST = 4), each record a protobuf Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # the rest of a block is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def test_wandb_offline_run_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb logger needs wandb (pip install 'hybridflow[loggers]')")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    _log_all(parse_logger_names("wandb"))
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    records = _wandb_records(runs[0])
    for _ in range(60):  # W&B's service process writes the log behind finish(): wait for its exit record
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.5)
        records = _wandb_records(runs[0])
    history = [{i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(json.loads(h["_step"]), json.loads(h["reward_mean"])) for h in history] == [(1, 0.25), (2, 0.75)]
    assert json.loads(history[0]["samples/_type"]) == "table-file" and "samples/_type" not in history[1]
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == "test-run" and run.project == "hybridflow"
    assert {u.key: json.loads(u.value_json) for u in run.config.update if u.key in PARAMS} == PARAMS


def test_mlflow_file_store_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="the mlflow logger needs mlflow (pip install 'hybridflow[loggers]')")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "mlruns"))  # a plain folder: the file store
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    _log_all(parse_logger_names("mlflow"))
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    run = client.search_runs([client.get_experiment_by_name("hybridflow").experiment_id])[0]
    assert run.info.run_name == "test-run" and run.info.status == "FINISHED"
    assert run.data.params == {"algorithm": "grpo", "actor_lr": "0.0002"}
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [(1, 0.25),
                                                                                                      (2, 0.75)]
    art = client.download_artifacts(run.info.run_id, "samples/iteration_000001.json", str(tmp_path / "dl"))
    assert json.loads(open(art).read()) == SAMPLES
