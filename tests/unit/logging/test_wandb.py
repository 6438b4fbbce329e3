"""log.use_wandb: the W&B sink in offline mode.  The history is read back from the offline run's ``.wandb`` file
(its records: LevelDB-log framing of ``wandb_internal_pb2.Record`` messages), so the test sees what
`wandb sync` would upload: the step axis is the global step, and a resumed attempt writes to the same run id."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from sft_fixtures import sft_config, with_paths

from hpc_rlhf import commands
from hpc_rlhf.cli import main
from hpc_rlhf.config import ConfigError
from hpc_rlhf.logging.metrics import MetricsLogger
from hpc_rlhf.logging.wandb_sink import MISSING, RUN_ID_FILE, check_installed, run_id_for

ROOT = Path(__file__).resolve().parents[3]
BLOCK = 32768  # the LevelDB log's block size; a record's chunks never cross one


def wandb_records(path: Path) -> list[bytes]:
    """The records of a .wandb file: a 7-byte header (":W&B", magic, version), then chunks of 7-byte header
    (CRC, length, type: 1 full, 2 first, 3 middle, 4 last) and data, padded to the block's end."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, out, parts = 7, [], b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the block's padding
            pos += left
            continue
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            parts = chunk
        elif kind == 3:
            parts += chunk
        elif kind == 4:
            out.append(parts + chunk)
    return out


def offline_runs(save: Path) -> list[dict]:
    """Per offline run folder (oldest first): its run id, name, project and history rows (step, values)."""
    from wandb.proto import wandb_internal_pb2 as pb
    found = []
    for f in sorted(save.glob("wandb/offline-run-*/run-*.wandb")):
        run = {"folder": f.parent.name, "history": []}
        for raw in wandb_records(f):
            r = pb.Record()
            r.ParseFromString(raw)
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run.update(id=r.run.run_id, name=r.run.display_name, project=r.run.project, group=r.run.run_group)
            elif kind == "history":
                values = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                run["history"].append((r.history.step.num, {k: v for k, v in values.items()
                                                            if not k.startswith("_")}))
        found.append(run)
    return found


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "unset")  # recorded, so the test's end restores the caller's environment
    monkeypatch.delenv("WANDB_MODE")  # the sink sets offline itself
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))  # dir= must win over it
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_the_sink_logs_the_global_step_offline_and_a_resumed_attempt_keeps_the_run_id(offline, tmp_path):
    save = tmp_path / "run"
    first = MetricsLogger(save, True, False, 0, {"project": "proj", "group": "g", "run_name": "r1"}, {"seed": 1})
    for step in (1, 2, 3):
        first.log(step, {"loss": 1.0 / step, "nan": float("nan"), "tag": "x"})
    first.close()
    assert os.environ["WANDB_MODE"] == "offline"
    run_id = (save / RUN_ID_FILE).read_text().strip()
    resumed = MetricsLogger(save, True, False, 2, {"project": "proj", "group": "g", "run_name": "r1"}, {"seed": 1})
    for step in (3, 4):
        resumed.log(step, {"loss": 10.0 / step})
    resumed.close()
    runs = offline_runs(save)
    assert [r["id"] for r in runs] == [run_id, run_id]  # one W&B run, two attempts (`wandb sync` joins them)
    assert runs[0]["name"] == "r1" and runs[0]["project"] == "proj" and runs[0]["group"] == "g"
    assert runs[0]["history"] == [(1, {"loss": 1.0}), (2, {"loss": 0.5}), (3, {"loss": pytest.approx(1 / 3)})]
    assert runs[1]["history"] == [(3, {"loss": pytest.approx(10 / 3)}), (4, {"loss": 2.5})]
    assert not (tmp_path / "elsewhere").exists()
    # a run starting at step 0 in the same folder is another W&B run
    fresh = MetricsLogger(save, True, False, 0, {"project": "proj"}, None)
    fresh.close()
    assert (save / RUN_ID_FILE).read_text().strip() != run_id


def test_run_id_for_reuses_the_stored_id_only_when_resuming(tmp_path):
    ids = iter(["aaaa1111", "bbbb2222"])
    assert run_id_for(tmp_path, 5, lambda: next(ids)) == "aaaa1111"  # nothing stored: a new id, stored
    assert run_id_for(tmp_path, 5, lambda: next(ids)) == "aaaa1111"
    assert run_id_for(tmp_path, 0, lambda: next(ids)) == "bbbb2222"
    assert (tmp_path / RUN_ID_FILE).read_text() == "bbbb2222\n"


def test_wandb_mode_set_by_the_user_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    m = MetricsLogger(tmp_path / "run", True, False, 0, {"project": "p"}, None)
    m.log(1, {"loss": 1.0})
    m.close()
    assert os.environ["WANDB_MODE"] == "disabled"
    assert not list((tmp_path / "run").glob("wandb/offline-run-*"))  # disabled: no run written, offline has one


def test_use_wandb_without_the_package_is_one_line_at_preflight(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    assert check_installed() == MISSING
    config = with_paths(sft_config(tmp_path, 2), tmp_path, "sft")
    capsys.readouterr()
    cfg = commands.load_config("train sft", str(config), ["log.use_wandb=true"])
    with pytest.raises(ConfigError, match=r"log.use_wandb needs the wandb package.*hpc_rlhf\[wandb\]"):
        commands.preflight("train sft", cfg)
    assert main(["train", "sft", "--config", str(config), "log.use_wandb=true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "log.use_wandb" in err and "pip install 'hpc_rlhf[wandb]'" in err
    assert not (tmp_path / "sft").exists()


def test_wandb_is_an_optional_extra_and_in_the_test_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(x.startswith("wandb") for x in extras["wandb"])
    assert any(x.startswith("wandb") for x in extras["test"])


def _train(path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "train", "sft", "--config", str(path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_a_stopped_then_resumed_sft_run_logs_to_one_wandb_run(tmp_path):
    """`train sft` with log.use_wandb (WANDB_MODE unset: offline): 4 steps with a checkpoint every 2 (the last
    step is exported, not checkpointed), then the same run to 6 steps resumes from step 2: it logs steps 3-6
    into the same W&B run; step 3's loss (computed from the checkpoint's weights, before max_steps changes the
    learning-rate schedule) is the first attempt's (exact resume)."""
    config = sft_config(tmp_path, 4)
    config["launch"] = {"nproc": 1}
    config["log"].update(use_wandb=True, wandb_project="t")
    path = with_paths(config, tmp_path, "sft")
    data = yaml.safe_load(path.read_text())
    data["ckpt"]["save_steps"] = 2
    path.write_text(yaml.safe_dump(data))
    _train(path)
    assert sorted(p.name for p in (tmp_path / "sft_ckpt").glob("global_step*")) == ["global_step2"]
    data["train"]["max_steps"] = 6
    data["ckpt"]["load_checkpoint"] = True
    path.write_text(yaml.safe_dump(data))
    _train(path)
    runs = offline_runs(tmp_path / "sft")
    attempts = [json.loads(x) for x in (tmp_path / "sft" / "attempts.jsonl").read_text().splitlines()]
    assert [a["start_step"] for a in attempts if a["event"] == "steps"] == [0, 2]
    assert len(runs) == 2 and runs[0]["id"] == runs[1]["id"] == (tmp_path / "sft" / RUN_ID_FILE).read_text().strip()
    first, second = ({s: v["loss"] for s, v in r["history"] if "loss" in v} for r in runs)
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [3, 4, 5, 6]  # the step axis is the global step
    assert second[3] == pytest.approx(first[3], abs=1e-6)
    metrics = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert {**first, **second} == {m["step"]: pytest.approx(m["loss"]) for m in metrics if "loss" in m}
