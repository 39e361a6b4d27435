"""Trackers: TensorBoard event files and a wandb run in offline mode (no network) hold what was logged, and no
secret from the environment reaches any file."""
import json
import struct
from pathlib import Path

import pytest

from grpo_recipe.config.schema import Config
from grpo_recipe.run.trackers import build_trackers

SECRET = "wandb-secret-3f9a1c-do-not-log"


def wandb_records(run_dir: Path) -> list:
    """The protobuf records of an offline run's .wandb file (wandb's LevelDB-style log: a 7-byte header, then
    32 KiB blocks of chunks: crc32, length, type (1 full, 2 first, 3 middle, 4 last), data)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    pos, part, records = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


def wandb_history(run_dir: Path) -> dict[int, dict]:
    """step -> {key: value} of everything logged (wandb's own _-prefixed keys left out)."""
    out = {}
    for r in wandb_records(run_dir):
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            out.setdefault(int(items["_step"]), {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return out


def wandb_config(run_dir: Path) -> dict:
    runs = [r.run for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "run"]
    return {i.key: json.loads(i.value_json) for i in runs[0].config.update}


def tensorboard_events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def assert_no_secret(folder: Path):
    for f in folder.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f"the secret reached {f}"


ROWS = [{"generation": 0, "prompt": [{"role": "user", "content": "2+2?"}], "completion": "4 | four", "reward": 1.0,
         "advantage": 0.5}]


def test_tensorboard_gets_scalars_and_the_completions_table(tmp_path):
    (tb,) = build_trackers(["tensorboard"], tmp_path, Config())
    tb.scalars({"loss": 0.25, "eval/greedy/reward": -3.0}, 1)
    tb.scalars({"loss": 0.5}, 2)
    tb.table("completions", ROWS, 2)
    tb.close()
    acc = tensorboard_events(tmp_path / "tensorboard")
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/greedy/reward")] == [(1, -3.0)]
    text = acc.Tensors("completions/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| generation | prompt | completion | reward | advantage |" in text and "4 \\| four" in text


def test_wandb_offline_run_holds_the_metrics_and_config_and_no_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = Config(wandb_project="grpo-test", run_name="unit", lr_scheduler_type="cosine", report_to=["wandb"])
    (wb,) = build_trackers(cfg.report_to, tmp_path, cfg)
    wb.scalars({"loss": 0.25, "learning_rate": 1e-3}, 1)
    wb.scalars({"loss": 0.5, "eval/greedy/reward": -3.0}, 2)
    wb.table("completions", ROWS, 2)
    wb.close()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    # recorded as this run's (an overwrite removes that folder, never another wandb run beside it)
    assert json.loads((tmp_path / "run.json").read_text())["written"] == [f"wandb/{run_dir.name}"]
    history = wandb_history(run_dir)
    assert history[1] == {"loss": 0.25, "learning_rate": 1e-3}
    assert history[2]["eval/greedy/reward"] == -3.0 and history[2]["completions/nrows"] == 1
    table = json.loads(next((run_dir / "files" / "media" / "table").glob("completions_*.table.json")).read_text())
    assert table["columns"] == list(ROWS[0]) and table["data"][0][2] == "4 | four"
    config = wandb_config(run_dir)
    assert config["lr_scheduler_type"] == "cosine" and config["wandb_project"] == "grpo-test"
    assert_no_secret(tmp_path)


def test_none_means_no_tracker():
    assert build_trackers(["none"], Path("/nonexistent"), Config()) == []
    with pytest.raises(KeyError):
        build_trackers(["mlflow"], Path("/nonexistent"), Config())  # config validation names it first
