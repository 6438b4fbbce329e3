"""`hpc-rlhf sweep`: the grid (pure functions, hand-written expected lists), the job array script, the checks
that stop a bad sweep before anything is written, the report's table of a sweep (hand-made metrics files),
and `--local` end to end on two tiny GRPO runs (slow)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from rl_fixtures import make_assets, merged

from hpc_rlhf.cli import main
from hpc_rlhf.launch.sweep import (Axis, SweepError, array_components, array_spec, expand, parse_grid, parse_seeds,
                                   plan_sweep, point_label, split_values)
from hpc_rlhf.reports import write_report
from hpc_rlhf.reports.sweep import load_sweep, point_metrics, spread, sweep_table

PY = sys.executable


# -- the grid -----------------------------------------------------------------------------------------------

def test_parse_grid_splits_on_commas_outside_quotes_and_brackets():
    assert parse_grid("algo.advantage_estimator=group_norm,rloo") == ("algo.advantage_estimator",
                                                                      ["group_norm", "rloo"])
    assert parse_grid("lr=1e-6") == ("lr", ["1e-6"])  # one value
    assert parse_grid("k= a , b ") == ("k", ["a", "b"])
    assert parse_grid("k=[1,2],[3]") == ("k", ["[1,2]", "[3]"])
    assert parse_grid("k={a: 1, b: 2},{}") == ("k", ["{a: 1, b: 2}", "{}"])
    assert parse_grid("k='x,y',\"z\"") == ("k", ["x,y", "z"])  # quotes around a whole value are removed
    assert parse_grid("k=a=b,c") == ("k", ["a=b", "c"])  # the first = ends the key
    assert split_values("'',b", "f") == ["", "b"]  # an empty string, quoted, is a value


@pytest.mark.parametrize("flag, why", [
    ("novalue", "write KEY=V1,V2"), ("=1,2", "write KEY=V1,V2"), ("k=", "write KEY=V1,V2"),
    ("k=1,,2", "an empty value"), ("k=1,", "an empty value"), ("k='1,2", "unbalanced '"),
    ("k=[1,2", "unbalanced brackets"), ("k=1,2,1", "value '1' is given twice")])
def test_bad_grid_flags_name_the_flag(flag, why):
    with pytest.raises(SweepError) as e:
        parse_grid(flag)
    assert str(e.value).startswith(f"--grid {flag!r}") and why in str(e.value)


def test_parse_seeds_count_or_list():
    assert parse_seeds(None, 42) is None
    assert parse_seeds("3", 42) == [42, 43, 44]
    assert parse_seeds("1", 7) == [7]
    assert parse_seeds("5,1,9", 42) == [5, 1, 9]
    for bad, why in (("0", "at least 1"), ("a", "count N or a list"), ("1,1", "given twice"), ("1,-2", ">= 0")):
        with pytest.raises(SweepError, match=why):
            parse_seeds(bad, 42)


def test_expand_is_the_product_in_flag_order_with_seeds_innermost():
    a = Axis("algo.advantage_estimator", ("group_norm", "rloo"), "f1")
    b = Axis("train.actor_learning_rate", ("1e-6", "3e-6"), "f2")
    runs = expand([a, b], [42, 43])
    assert [(r.index, r.point, r.seed) for r in runs] == [(i, i // 2, 42 + i % 2) for i in range(8)]
    assert [r.overrides for r in runs[:3]] == [
        (("algo.advantage_estimator", "group_norm"), ("train.actor_learning_rate", "1e-6"), ("train.seed", "42")),
        (("algo.advantage_estimator", "group_norm"), ("train.actor_learning_rate", "1e-6"), ("train.seed", "43")),
        (("algo.advantage_estimator", "group_norm"), ("train.actor_learning_rate", "3e-6"), ("train.seed", "42"))]
    assert [r.label for r in runs[::2]] == [
        "advantage_estimator=group_norm, actor_learning_rate=1e-6",
        "advantage_estimator=group_norm, actor_learning_rate=3e-6",
        "advantage_estimator=rloo, actor_learning_rate=1e-6", "advantage_estimator=rloo, actor_learning_rate=3e-6"]
    assert [r.name for r in runs[:2]] == ["000", "001"]


def test_expand_edge_cases():
    one = expand([Axis("k", ("v",), "f")], None)  # one value, no seeds: one run with the config's seed
    assert [(r.index, r.grid, r.seed, r.overrides) for r in one] == [(0, (("k", "v"),), None, (("k", "v"),))]
    base = expand([], [1, 2])  # no grid: the base config once per seed
    assert [(r.point, r.overrides, r.label) for r in base] == [(0, (("train.seed", "1"),), "base config"),
                                                               (0, (("train.seed", "2"),), "base config")]
    assert point_label((("train.seed", "3"),)) == "seed=3"  # a seed swept by --grid is part of the point


def test_array_spec_and_throttle():
    assert array_spec(4, 2) == "0-3%2"
    assert array_spec(1, None) == "0-0"


# -- a planned sweep (configs checked, nothing written) ------------------------------------------------------

@pytest.fixture(scope="module")
def base_yaml(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep_assets")
    config = merged(make_assets(root), train={"max_steps": 2}, log={"use_tensorboard": False},
                    slurm={"hetjob": "always", "roles": {"rollout": {"cpus_per_task": 2}}, "python": "python"})
    path = root / "base.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_array_script_is_homogeneous_and_picks_the_config_by_task_id(base_yaml, tmp_path):
    p = plan_sweep("rl", str(base_yaml), [], ["algo.advantage_estimator=group_norm,rloo",
                                              "actor_learning_rate=1e-3,3e-3"], None, str(tmp_path / "sw"), 2,
                   local=False)
    assert not (tmp_path / "sw").exists()  # planning writes nothing
    s = p.script
    assert "hetjob" not in s and "--het-group" not in s  # SLURM has no heterogeneous job arrays
    assert "#SBATCH --job-name=hpc-rlhf --array=0-3%2 " in s and " --requeue --no-kill --signal=USR1@300" in s
    # one allocation of the plan's 3 ranks, each with the most CPUs a group asks for (rollout: 2)
    assert "#SBATCH --ntasks=3 --cpus-per-task=2\n" in s
    assert f'POINT_CONFIG="{tmp_path}/sw/configs/$(printf %03d "$SLURM_ARRAY_TASK_ID").yaml"' in s
    assert 'CMD=(python -m hpc_rlhf.cli train rl --config "$POINT_CONFIG")' in s
    # each element's step, started again after a failure, logs into sw/logs/JOBID/attempt-N[/restart-K]
    assert f"python -m hpc_rlhf.cli steps --log-dir {tmp_path}/sw/logs --ntasks 3 --max-restarts 2 " in s
    cfgs = p.configs
    assert [(c.algo.advantage_estimator, c.train.actor_learning_rate) for c in cfgs] == [
        ("group_norm", 1e-3), ("group_norm", 3e-3), ("rloo", 1e-3), ("rloo", 3e-3)]
    assert [c.ckpt.save_path for c in cfgs] == [str(tmp_path / "sw" / "runs" / f"00{i}") for i in range(4)]
    assert cfgs[3].ckpt.ckpt_path == str(tmp_path / "sw" / "runs" / "003" / "checkpoints")
    assert {c.slurm.log_dir for c in cfgs} == {str(tmp_path / "sw" / "logs")}
    m = p.manifest
    assert m["grid"] == [{"key": "algo.advantage_estimator", "values": ["group_norm", "rloo"]},
                         {"key": "train.actor_learning_rate", "values": ["1e-3", "3e-3"]}]
    assert [pt["runs"] for pt in m["points"]][1] == [{"index": 1, "seed": None, "config": "configs/001.yaml",
                                                      "run_dir": "runs/001"}]


def test_with_wandb_the_sweep_is_a_group_and_each_run_named_by_its_point(base_yaml, tmp_path):
    p = plan_sweep("rl", str(base_yaml), ["log.use_wandb=true"], ["algo.advantage_estimator=group_norm,rloo"], "2",
                   str(tmp_path / "my-sweep"), None, local=True)
    assert {c.log.wandb_group for c in p.configs} == {"my-sweep"}
    assert [c.log.wandb_run_name for c in p.configs] == [
        "advantage_estimator=group_norm, seed 5", "advantage_estimator=group_norm, seed 6",
        "advantage_estimator=rloo, seed 5", "advantage_estimator=rloo, seed 6"]
    own = plan_sweep("rl", str(base_yaml), ["log.use_wandb=true", "log.wandb_group=mine"], [], None,
                     str(tmp_path / "b"), None, local=True)
    assert own.configs[0].log.wandb_group == "mine" and own.configs[0].log.wandb_run_name == "base config"


def test_render_refuses_a_heterogeneous_array_and_writes_raw_arguments_unquoted(base_yaml):
    from hpc_rlhf import commands
    from hpc_rlhf.launch.job import components
    from hpc_rlhf.launch.sbatch import Raw, render
    cfg = commands.load_config("train rl", str(base_yaml), [])
    comps = components(cfg, commands.placement_plan("train rl", cfg))
    with pytest.raises(ValueError, match="no heterogeneous job arrays"):
        render(comps, cfg.slurm, ["x"], "/logs", array="0-1")  # the config asks for hetjob=always
    import dataclasses
    s = render(array_components(comps), dataclasses.replace(cfg.slurm, hetjob="never"),
               ["run", "a b", Raw('"$V"')], "/logs", array="0-1", prelude=["V=1"])
    assert "--array=0-1" in s and "V=1\nCMD=(run 'a b' \"$V\")\n" in s


def test_array_components_refuse_groups_on_different_partitions(base_yaml):
    from hpc_rlhf import commands
    from hpc_rlhf.launch.job import components
    cfg = commands.load_config("train rl", str(base_yaml), ["slurm.roles.rollout.partition=gpu"])
    with pytest.raises(ValueError, match="different partitions"):
        array_components(components(cfg, commands.placement_plan("train rl", cfg)))


def test_the_command_writes_configs_manifest_and_script_and_dry_run_writes_nothing(base_yaml, tmp_path, capsys,
                                                                                  monkeypatch):
    out = tmp_path / "sw"
    args = ["sweep", "--config", str(base_yaml), "--grid", "algo.advantage_estimator=group_norm,rloo",
            "--seeds", "2", "--out", str(out), "--max-parallel", "3"]
    assert main([*args, "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "001  advantage_estimator=group_norm  seed 6" in text and "--array=0-3%3" in text
    assert not out.exists()
    # no sbatch on PATH (no SLURM here): everything is written, then one line says so (exit 2)
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpc-rlhf sweep: sbatch not found: no SLURM here") and err.count("\n") == 1
    assert sorted(p.name for p in (out / "configs").iterdir()) == ["000.yaml", "001.yaml", "002.yaml", "003.yaml"]
    third = yaml.safe_load((out / "configs" / "002.yaml").read_text())
    assert third["algo"]["advantage_estimator"] == "rloo" and third["train"]["seed"] == 5
    assert third["ckpt"]["save_path"] == str(out / "runs" / "002")
    manifest = json.loads((out / "sweep.json").read_text())
    assert manifest["seeds"] == [5, 6] and [p["label"] for p in manifest["points"]] == [
        "advantage_estimator=group_norm", "advantage_estimator=rloo"]
    assert (out / "sweep.sbatch").read_text().count("--array=0-3%3") == 1
    # the same sweep again into the same folder is accepted (it resumes); another one is refused
    assert main([*args[:-2], "--dry-run"]) == 0
    assert main(["sweep", "--config", str(base_yaml), "--grid", "algo.advantage_estimator=rloo",
                 "--out", str(out), "--dry-run"]) == 2
    assert "holds another sweep" in capsys.readouterr().err


@pytest.mark.parametrize("extra, why", [
    (["--grid", "no_such_option=1,2"], "--grid 'no_such_option=1,2': unknown option 'no_such_option'"),
    (["--grid", "algo.advantage_estimator=group_norm,nonsense"], "--grid 'algo.advantage_estimator=group_norm,"
                                                                  "nonsense': "),
    (["--grid", "actor_learning_rate=1e-3,-1"], "--grid 'actor_learning_rate=1e-3,-1': "),
    (["--grid", "actor_learning_rate=1e-3", "--grid", "train.actor_learning_rate=2e-3"],
     "train.actor_learning_rate is already swept by --grid 'actor_learning_rate=1e-3'"),
    (["--grid", "seed=1,2", "--seeds", "2"], "train.seed is swept by --seeds already"),
    (["--grid", "slurm.time=1:00,2:00"], "share its sbatch options"),
    (["--grid", "ckpt.save_path=a,b"], "set by the sweep itself"),
    (["--grid", "k=1,,2"], "--grid 'k=1,,2': an empty value"),
    (["--seeds", "0"], "--seeds '0': the count must be at least 1"),
    (["--max-parallel", "0"], "--max-parallel 0: at least 1"),
])
def test_bad_sweeps_stop_with_one_line_naming_the_flag_before_anything_is_written(base_yaml, tmp_path, capsys,
                                                                                  extra, why):
    out = tmp_path / "sw"
    assert main(["sweep", "--config", str(base_yaml), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1, err
    assert not out.exists()


def test_a_grid_that_changes_the_ranks_cannot_be_one_job_array(base_yaml, tmp_path, capsys):
    out = tmp_path / "sw"
    assert main(["sweep", "--config", str(base_yaml), "--out", str(out), "--grid",
                 "placement.colocate_all=false,true"]) == 2
    err = capsys.readouterr().err
    assert "other ranks or resources than run 000" in err and err.count("\n") == 1 and not out.exists()


def test_the_trainer_is_named_like_submit_and_defaults_to_rl(base_yaml, tmp_path, capsys):
    assert main(["sweep", "nosuch", "--config", str(base_yaml), "--dry-run"]) == 2
    assert "TRAINER 'nosuch' is not one of" in capsys.readouterr().err
    assert main(["sweep", "rl", "--config", str(base_yaml), "--out", str(tmp_path / "a"), "--dry-run",
                 "train.max_steps=3"]) == 0
    assert main(["sweep", "--config", str(base_yaml), "--out", str(tmp_path / "b"), "--dry-run",
                 "train.max_steps=3"]) == 0  # an override where TRAINER would go
    assert "base config" in capsys.readouterr().out


# -- the report of a sweep ----------------------------------------------------------------------------------

def test_spread_mean_sample_std_min_max():
    assert spread([]) == {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    assert spread([2.0]) == {"n": 1, "mean": 2.0, "std": None, "min": 2.0, "max": 2.0}
    s = spread([1.0, 2.0, 6.0])  # mean 3, squared deviations 4 + 1 + 9 = 14, / (3 - 1) = 7
    assert s["mean"] == 3.0 and s["std"] == pytest.approx(math.sqrt(7)) and (s["min"], s["max"]) == (1.0, 6.0)


def _rl_rows(rewards: list[float], losses: list[float]) -> str:
    return "".join(json.dumps({"step": i + 1, "reward/mean": r, "critic/loss": c, "time/step_s": 1.0}) + "\n"
                   for i, (r, c) in enumerate(zip(rewards, losses)))


def _hand_made_sweep(root: Path) -> Path:
    """Two points, two seeds each; point B's second run has not logged yet."""
    runs = {"000": ([0.1, 0.5, 0.3], [2.0, 1.0, 1.5]), "001": ([0.2, 0.4, 0.4], [3.0, 0.5, 0.5]),
            "002": ([0.6, 0.9, 0.7], [1.0, 0.2, 0.4])}
    for name, (rewards, losses) in runs.items():
        (root / "runs" / name).mkdir(parents=True)
        (root / "runs" / name / "metrics.jsonl").write_text(_rl_rows(rewards, losses))
    (root / "runs" / "003").mkdir(parents=True)

    def run(i, seed):
        return {"index": i, "seed": seed, "config": f"configs/00{i}.yaml", "run_dir": f"runs/00{i}"}
    manifest = {"version": 1, "trainer": "rl", "grid": [{"key": "algo.advantage_estimator", "values": ["a", "b"]}],
                "seeds": [1, 2], "points": [
                    {"label": "advantage_estimator=a", "overrides": {"algo.advantage_estimator": "a"},
                     "runs": [run(0, 1), run(1, 2)]},
                    {"label": "advantage_estimator=b", "overrides": {"algo.advantage_estimator": "b"},
                     "runs": [run(2, 1), run(3, 2)]}],
                "submissions": [{"time": 0, "array_job_id": "77", "array": "0-3%2"}]}
    (root / "sweep.json").write_text(json.dumps(manifest))
    return root


def test_the_sweep_table_has_final_and_best_mean_and_spread_per_point(tmp_path):
    sweep = load_sweep(_hand_made_sweep(tmp_path / "sw"))
    assert [[r.label for r in p.runs] for p in sweep.points] == [
        ["advantage_estimator=a, seed 1", "advantage_estimator=a, seed 2"], ["advantage_estimator=b, seed 1"]]
    assert sweep.points[1].waiting == [str(tmp_path / "sw" / "runs" / "003")]
    from hpc_rlhf.reports.summary import summarize
    a = point_metrics([summarize(r) for r in sweep.points[0].runs])
    # reward (higher is better): finals 0.3, 0.4; bests 0.5, 0.4.  critic loss (lower): finals 1.5, 0.5; bests 1.0, 0.5
    assert a["reward/mean"]["final"]["mean"] == pytest.approx(0.35)
    assert a["reward/mean"]["final"]["std"] == pytest.approx(math.sqrt(0.005))  # (0.05² + 0.05²) / 1
    assert a["reward/mean"]["best"]["mean"] == pytest.approx(0.45)
    assert (a["critic/loss"]["best"]["min"], a["critic/loss"]["best"]["max"]) == (0.5, 1.0)
    table = sweep_table([(p.label, [summarize(r) for r in p.runs]) for p in sweep.points])
    assert table[0] == ["point", "metric", "runs", "final (mean ± std)", "final min – max", "best (mean ± std)",
                        "best min – max"]
    assert table[1:] == [
        ["advantage_estimator=a", "reward/mean", "2", "0.35 ± 0.07071", "0.3 – 0.4", "0.45 ± 0.07071", "0.4 – 0.5"],
        ["advantage_estimator=a", "critic/loss", "2", "1 ± 0.7071", "0.5 – 1.5", "0.75 ± 0.3536", "0.5 – 1"],
        ["advantage_estimator=b", "reward/mean", "1", "0.7", "—", "0.9", "—"],
        ["advantage_estimator=b", "critic/loss", "1", "0.4", "—", "0.2", "—"]]


def test_report_of_a_sweep_folder_writes_the_table_and_overlays_points(tmp_path):
    sw = _hand_made_sweep(tmp_path / "sw")
    rep = write_report([sw], tmp_path / "out")
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| advantage_estimator=a | reward/mean | 2 | 0.35 ± 0.07071 | 0.3 – 0.4 | 0.45 ± 0.07071 | 0.4 – 0.5 |" in md
    assert "SLURM job array 77 (--array=0-3%2)" in md and "runs/003 has no metrics yet" in md
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<td>0.35 ± 0.07071</td>" in page and "reward.png" in page
    assert rep.sweep_rows[1][0] == "advantage_estimator=a"
    from hpc_rlhf.reports.plots import run_colors
    sweep = load_sweep(sw)
    colors = run_colors(sweep.runs)  # a point's seeds share its colour
    assert colors["advantage_estimator=a, seed 1"] == colors["advantage_estimator=a, seed 2"]
    assert colors["advantage_estimator=a, seed 1"] != colors["advantage_estimator=b, seed 1"]
    with pytest.raises(Exception, match="is a sweep folder: report it alone"):
        write_report([sw, sw / "runs" / "000"], tmp_path / "out2")


def test_the_report_command_on_a_sweep_folder(tmp_path, capsys):
    sw = _hand_made_sweep(tmp_path / "sw")
    assert main(["report", str(sw), "--out", str(tmp_path / "r")]) == 0
    assert "report.html and summary.md" in capsys.readouterr().out
    md = (tmp_path / "r" / "summary.md").read_text()
    assert "| advantage_estimator=b | reward/mean | 1 | 0.7 | — | 0.9 | — |" in md
    (sw / "sweep.json").write_text("{}")
    assert main(["report", str(sw), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "not a sweep manifest" in err and err.count("\n") == 1


# -- --local end to end -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_local_sweep_of_two_tiny_grpo_runs(base_yaml, tmp_path):
    out = tmp_path / "sw"
    proc = subprocess.run([PY, "-m", "hpc_rlhf.cli", "sweep", "--config", str(base_yaml), "--local", "--out",
                           str(out), "--grid", "algo.advantage_estimator=group_norm,rloo"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "run 001 (advantage_estimator=rloo) finished" in proc.stdout
    for name, algo in (("000", "group_norm"), ("001", "rloo")):
        exported = yaml.safe_load((out / "runs" / name / "hpc_rlhf_config.yaml").read_text())
        assert exported["algo"]["advantage_estimator"] == algo
    rep = write_report([out], tmp_path / "report")
    rows = {(r[0], r[1]): r for r in rep.sweep_rows[1:]}
    for name, algo in (("000", "group_norm"), ("001", "rloo")):
        metrics = [json.loads(x) for x in (out / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        final = [m["reward/mean"] for m in metrics if "reward/mean" in m][-1]
        from hpc_rlhf.reports.summary import fmt_value
        assert rows[(f"advantage_estimator={algo}", "reward/mean")][3] == fmt_value(final)
