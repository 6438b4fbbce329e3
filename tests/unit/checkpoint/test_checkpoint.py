"""The checkpoint store on one process with stand-in engines: the manifest, the fall-back to the newest intact
checkpoint, and what a run does with checkpoints it finds in ckpt_path (resume, refuse, start over)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from hpc_rlhf.checkpoint.existing import IGNORED, choose, config_differences
from hpc_rlhf.checkpoint.manifest import HASHED_UP_TO, MANIFEST
from hpc_rlhf.checkpoint.layout import CheckpointError, committed_steps, newest_intact
from hpc_rlhf.checkpoint.store import load_checkpoint, save_checkpoint
from hpc_rlhf.config import ConfigError, SFTConfig, dump_yaml, load_config
from hpc_rlhf.config.base import leaf_paths
from hpc_rlhf.config.rl import RLConfig
from hpc_rlhf.trainers.lifecycle import resume

MODEL = "model/mp_rank_00_model_states.pt"


class Engine:
    """What the store asks of a DeepSpeed engine: save and load its folder (one weight tensor here)."""

    def __init__(self, value: float):
        self.weight = torch.full((HASHED_UP_TO // 4 + 1000,), value)  # bigger than the hashed files

    def save_checkpoint(self, folder, tag, save_latest):
        (Path(folder) / tag).mkdir()
        torch.save({"weight": self.weight}, Path(folder) / tag / "mp_rank_00_model_states.pt")

    def load_checkpoint(self, folder, tag, **_):
        self.weight = torch.load(Path(folder) / tag / "mp_rank_00_model_states.pt")["weight"]
        return folder, {}


def config(ckpt: Path, *overrides: str):
    return load_config(SFTConfig, None, ["pretrain=m", "dataset=d", f"ckpt_path={ckpt}", *overrides])


def save(cfg, step: int, max_keep: int = 5) -> Path:
    return save_checkpoint({"model": Engine(float(step))}, cfg.ckpt.ckpt_path, step, {"step": step}, max_keep,
                           run_config=dump_yaml(cfg), rank=0, barrier=lambda: None)


def truncate(path: Path, size: int = 100) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def same(value: int) -> int:  # the maximum over the ranks of a one-rank job
    return value


@pytest.fixture
def two_steps(tmp_path):
    cfg = config(tmp_path / "ckpt", "save_steps=1")
    save(cfg, 1)
    save(cfg, 2)
    return cfg, tmp_path / "ckpt"


def test_the_manifest_lists_every_file_with_its_size_and_hashes_the_small_ones(two_steps):
    _, root = two_steps
    folder = root / "global_step2"
    files = json.loads((folder / MANIFEST).read_text())["files"]
    assert sorted(files) == ["config.yaml", MODEL, "rng_rank0.pt", "trainer.json"]
    for rel, entry in files.items():
        size = (folder / rel).stat().st_size
        assert entry["size"] == size
        assert ("sha256" in entry) == (size <= HASHED_UP_TO), rel
    assert "sha256" not in files[MODEL]
    assert (folder / "config.yaml").read_text() == dump_yaml(config(root, "save_steps=1"))


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one_with_a_warning_naming_the_file(
        two_steps, caplog):
    cfg, root = two_steps
    truncate(root / "global_step2" / MODEL)
    with caplog.at_level(logging.WARNING):
        path, damaged = choose(cfg.ckpt, dump_yaml(cfg), restarted=False, report=True)
    assert path == root / "global_step1"
    size = (root / "global_step1" / MODEL).stat().st_size
    assert damaged == [(root / "global_step2", f"{root / 'global_step2' / MODEL}: {size} bytes expected, 100 found")]
    assert f"{root / 'global_step2' / MODEL}: {size} bytes expected, 100 found" in caplog.text


@pytest.mark.parametrize("harm, what", [
    (lambda f: f.unlink(), "missing"),
    (lambda f: f.write_bytes(bytes(f.stat().st_size)), "sha256 differs"),  # same size, other content
    (lambda f: truncate(f, 0), "bytes expected, 0 found"),
])
def test_missing_and_changed_small_files_are_damage(two_steps, harm, what):
    _, root = two_steps
    harm(root / "global_step2" / "rng_rank0.pt")
    path, [(folder, why)] = newest_intact(root)
    assert (path, folder) == (root / "global_step1", root / "global_step2")
    assert why.startswith(f"{root / 'global_step2' / 'rng_rank0.pt'}: ") and what in why


def test_no_intact_checkpoint_is_one_line_naming_every_damaged_file(two_steps):
    cfg, root = two_steps
    truncate(root / "global_step2" / MODEL)
    (root / "global_step1" / "trainer.json").unlink()
    with pytest.raises(CheckpointError) as e:
        choose(cfg.ckpt, dump_yaml(cfg), restarted=False, report=True)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{root / 'global_step2' / MODEL}: " in msg and f"{root / 'global_step1' / 'trainer.json'}: missing" in msg
    assert "ckpt.start_over=true" in msg


def test_a_checkpoint_without_manifest_loads_unverified(two_steps, caplog):
    cfg, root = two_steps
    (root / "global_step2" / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING):
        path, _ = choose(cfg.ckpt, dump_yaml(cfg), restarted=False, report=True)
    assert path == root / "global_step2"
    assert f"{root / 'global_step2'} has no manifest" in caplog.text and "unverified" in caplog.text


def test_the_fallback_sets_the_damaged_checkpoint_aside_so_that_pruning_keeps_the_intact_one(tmp_path):
    """Checkpoints 1 (intact) and 3 (damaged), max_ckpt_num=1: the resumed run's save of step 2 must not leave
    only the damaged step 3 (it would count as the newest of those kept and the intact ones be removed)."""
    cfg = config(tmp_path / "ckpt", "max_ckpt_num=1")
    root = tmp_path / "ckpt"
    save(cfg, 1)
    save(cfg, 3, max_keep=2)
    truncate(root / "global_step3" / MODEL)
    engine = Engine(0.0)
    state = resume({"model": engine}, cfg, is_main=True, agree=same)
    assert state["step"] == 1 and float(engine.weight[0]) == 1.0
    save(cfg, 2, max_keep=1)
    assert committed_steps(root) == [2]
    assert newest_intact(root) == (root / "global_step2", [])
    [aside] = root.glob("global_step3.damaged-*")
    assert (aside / MODEL).stat().st_size == 100  # kept for a look, never loaded


def test_ranks_that_chose_different_checkpoints_stop_before_loading(two_steps):
    cfg, _ = two_steps
    engine = Engine(0.0)
    with pytest.raises(CheckpointError, match="the ranks chose different checkpoints"):
        resume({"model": engine}, cfg, is_main=True, agree=lambda v: v + 1)  # another rank saw another step
    assert float(engine.weight[0]) == 0.0


def test_an_unreadable_rng_file_is_named_and_stops_every_rank(two_steps):
    """Without a manifest (an older checkpoint) a damaged file is found only by loading it: the rank that
    fails names it, the others stop too instead of waiting for it in a collective."""
    _, root = two_steps
    folder = root / "global_step2"
    (folder / MANIFEST).unlink()
    truncate(folder / "rng_rank0.pt")
    engine = Engine(0.0)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint({"model": engine}, folder, rank=0, agree=same)
    assert str(e.value).startswith(f"{folder / 'rng_rank0.pt'} cannot be loaded (") and "\n" not in str(e.value)
    assert float(engine.weight[0]) == 0.0  # stopped before the engines
    with pytest.raises(CheckpointError, match="another rank could not load its part"):
        load_checkpoint({"model": engine}, root / "global_step1", rank=0, agree=lambda failed: 1)


def test_only_the_listed_options_are_ignored_when_comparing_configs(tmp_path):
    a = config(tmp_path)
    b = config(tmp_path / "other", "load_checkpoint=true", "save_path=x", "max_ckpt_num=7", "logging_steps=5",
               "slurm.time=02:00:00", "launch.backend=gloo")
    assert config_differences(dump_yaml(a), dump_yaml(b)) == {}
    c = config(tmp_path, "learning_rate=0.5", "launch.nproc=2", "max_len=99")
    assert config_differences(dump_yaml(a), dump_yaml(c)) == {
        "data.max_len": (a.data.max_len, 99), "launch.nproc": (1, 2), "train.learning_rate": (5e-6, 0.5)}
    options = leaf_paths(RLConfig)
    for key in IGNORED:  # each names a section or an option (of RLConfig, which has every section)
        assert any(o.startswith(key) for o in options) if key.endswith(".") else key in options, key


def test_checkpoints_of_the_same_config_resume_and_of_another_config_refuse(two_steps, caplog):
    cfg, root = two_steps
    with caplog.at_level(logging.INFO):
        assert choose(cfg.ckpt, dump_yaml(cfg), restarted=False, report=True) == (root / "global_step2", [])
    assert "holds checkpoints of this config: resuming from global_step2" in caplog.text
    other = config(root, "save_steps=1", "max_steps=10")
    with pytest.raises(CheckpointError) as e:
        choose(other.ckpt, dump_yaml(other), restarted=False, report=True)
    assert str(e.value) == (f"{root} holds checkpoints of another config (global_step2: train.max_steps None -> 10): "
                            f"pass load_checkpoint=true to resume from it anyway, or ckpt.start_over=true to move "
                            f"the checkpoints into a dated folder under ckpt_path and start from step 0")
    asked = config(root, "save_steps=1", "max_steps=10", "load_checkpoint=true")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert choose(asked.ckpt, dump_yaml(asked), restarted=False, report=True)[0] == root / "global_step2"
    assert "written with another config: train.max_steps None -> 10" in caplog.text
    (root / "global_step2" / "config.yaml").unlink()  # as an older version wrote them (and no manifest)
    (root / "global_step2" / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="whose config was not recorded .* load_checkpoint=true"):
        choose(cfg.ckpt, dump_yaml(cfg), restarted=False, report=True)


def test_a_requeued_job_resumes_whatever_its_options_say(two_steps, monkeypatch):
    cfg, root = two_steps
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    for overrides in (["max_steps=10"], ["start_over=true"]):
        other = config(root, *overrides)
        assert choose(other.ckpt, dump_yaml(other), restarted=True, report=True)[0] == root / "global_step2"
        assert resume({"model": Engine(0.0)}, other, is_main=True, agree=same)["step"] == 2
    assert committed_steps(root) == [1, 2]


def test_start_over_moves_the_checkpoints_aside_and_deletes_nothing(two_steps, caplog):
    cfg, root = two_steps
    truncate(root / "global_step2" / MODEL)
    resume({"model": Engine(0.0)}, cfg, is_main=True, agree=same)  # sets the damaged one aside
    (root / ".tmp-global_step3").mkdir()  # a save that never finished
    before = tree(root)
    fresh = config(root, "start_over=true")
    assert choose(fresh.ckpt, dump_yaml(fresh), restarted=False, report=True) == (None, [])  # the CLI lets it run
    assert tree(root) == before
    with caplog.at_level(logging.WARNING):
        assert resume({"model": Engine(0.0)}, fresh, is_main=True, agree=same) is None
    [old] = root.iterdir()
    assert old.name.startswith("old-") and f"moved the checkpoints of {root} into {old}" in caplog.text
    assert tree(old) == before
    assert choose(cfg.ckpt, dump_yaml(cfg), restarted=False, report=True) == (None, [])  # nothing left to resume


def test_load_checkpoint_and_start_over_contradict(tmp_path):
    with pytest.raises(ConfigError, match="load_checkpoint and ckpt.start_over"):
        config(tmp_path, "load_checkpoint=true", "start_over=true")
