"""`hpc-rlhf report`: reading run folders (half-written lines, resumed attempts, TensorBoard event files, the
config of a run still going), the numbers of the summary (phases, final and best values), and the files
written (PNGs, a self-contained report.html, summary.md); one real tiny `train rl` run at the end."""
from __future__ import annotations

import argparse
import base64
import json
import re
import struct
import tomllib
from pathlib import Path

import pytest
import yaml

from hpc_rlhf.cli import build_parser
from hpc_rlhf.entrypoints.tools import add_report_args, report
from hpc_rlhf.reports import ReportError, load_run, write_report
from hpc_rlhf.reports.plots import charts, has_data, running_mean, series, smoothing_half_width
from hpc_rlhf.reports.runs import (Attempt, join_attempts, parse_event, read_attempts, read_events, read_rows,
                                   run_labels)
from hpc_rlhf.reports.summary import (direction, eval_keys, final_and_best, phase_split, phase_totals, shares,
                                      summarize, wall_seconds)

ROOT = Path(__file__).resolve().parents[3]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- helpers: metrics files and TensorBoard event files written by hand -------------------------------------

def write_rows(path: Path, rows: list[dict], tail: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def event(wall: float, step: int, summary: bool) -> bytes:
    """An Event message: wall_time (field 1, double), step (field 2, varint), summary (field 5, bytes) or
    file_version (field 3, a string)."""
    body = b"\x09" + struct.pack("<d", wall) + b"\x10" + _varint(step)
    return body + (b"\x2a\x03abc" if summary else b"\x1a\x05brain")


def write_events(path: Path, events: list[bytes]) -> Path:
    """TFRecord framing (length, its CRC, data, its CRC); the CRCs are not read by the report: zeros."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(struct.pack("<Q", len(e)) + b"\0" * 4 + e + b"\0" * 4 for e in events))
    return path


def attempt_file(run: Path, name: str, start: float, steps: list[tuple[int, float]]) -> Path:
    """One attempt's event file: the file_version event at ``start``, then a summary per (step, wall time)."""
    return write_events(run / "tensorboard" / f"events.out.tfevents.{name}",
                        [event(start, 0, False)] + [event(t, s, True) for s, t in steps])


def rl_row(step: int, reward: float, **extra) -> dict:
    return {"step": step, "reward/mean": reward, "kl": 0.01 * step, "actor/loss": -0.1, "actor/lr": 1e-6,
            "actor/grad_norm": 2.0, "response_length/mean": 10.0 + step, "response_length/truncated": 0.25,
            "time/generate_score_s": 4.0, "time/rollout_generate_s": 3.0, "time/infer_advantages_s": 1.0,
            "time/train_s": 4.0, "time/weight_sync_s": 0.5, "time/step_s": 10.0, **extra}


# -- metrics.jsonl ------------------------------------------------------------------------------------------

def test_a_half_written_last_line_is_left_out(tmp_path):
    path = write_rows(tmp_path / "metrics.jsonl", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}],
                      tail='{"step": 3, "loss": 1.')
    assert read_rows(path) == ([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}], True)
    write_rows(path, [{"step": 1, "loss": 2.0}])
    assert read_rows(path) == ([{"step": 1, "loss": 2.0}], False)


@pytest.mark.parametrize("bad, why", [('{"step": 2, "loss": 1.', "not a JSON object"),
                                      ('{"loss": 1.0}', 'needs an integer "step"'),
                                      ('{"step": "2"}', 'needs an integer "step"')])
def test_a_bad_line_before_the_last_is_an_error_naming_file_and_line(tmp_path, bad, why):
    path = tmp_path / "metrics.jsonl"
    path.write_text(f'{{"step": 1}}\n{bad}\n{{"step": 3}}\n')
    with pytest.raises(ReportError, match=re.escape(f"{path}:2: ") + ".*" + re.escape(why)):
        read_rows(path)


def test_rows_of_one_step_merge_the_later_values_winning():
    # a step's row, then its eval row and the export row (same step): one row
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "eval_loss": 2.5},
            {"step": 2, "loss": 1.9, "reward_mean": 0.5}]
    assert join_attempts(rows) == [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 1.9, "eval_loss": 2.5,
                                                               "reward_mean": 0.5}]


def test_a_resumed_attempt_replaces_the_rows_after_its_checkpoint():
    first = [{"step": s, "loss": 10.0 - s, "extra": s} for s in (1, 2, 3, 4, 5)]
    # resumed from the checkpoint of step 3: its eval at the start is logged at step 3, then steps 4 and 5
    second = [{"step": 3, "eval_loss": 7.5}, {"step": 4, "loss": 0.4}]
    joined = join_attempts(first + second)
    assert joined == [{"step": 1, "loss": 9.0, "extra": 1}, {"step": 2, "loss": 8.0, "extra": 2},
                      {"step": 3, "loss": 7.0, "extra": 3, "eval_loss": 7.5},  # the checkpoint's step: merged
                      {"step": 4, "loss": 0.4}]  # the old step 4 is gone, old step 5 too (not redone yet)
    # a third attempt from step 1 (no checkpoint survived): only its own rows remain from step 1 on
    assert join_attempts(first + second + [{"step": 1, "loss": 5.0}]) == [{"step": 1, "loss": 5.0, "extra": 1}]


def test_values_that_are_not_finite_are_dropped():
    assert join_attempts([{"step": 1, "a": float("nan"), "b": float("inf"), "c": 1.0, "d": "x"}]) == \
        [{"step": 1, "c": 1.0, "d": "x"}]


# -- TensorBoard event files --------------------------------------------------------------------------------

def test_parse_event_reads_wall_time_step_and_whether_it_is_a_summary():
    assert parse_event(event(12.5, 7, True)) == (12.5, 7, True)
    assert parse_event(event(3.0, 0, False)) == (3.0, 0, False)
    assert parse_event(event(1.0, -1, True)) == (1.0, -1, True)  # int64 as a 10-byte varint
    # an unknown fixed32 field (wire type 5) is skipped
    assert parse_event(b"\x3d\x00\x00\x00\x00" + event(2.0, 4, True)) == (2.0, 4, True)
    with pytest.raises(ValueError):
        parse_event(b"\x09\x00\x00")  # a double cut short


def test_read_events_stops_at_a_record_cut_short(tmp_path):
    path = write_events(tmp_path / "ev", [event(1.0, 0, False), event(2.0, 1, True), event(3.0, 2, True)])
    assert read_events(path) == [(1.0, 0, False), (2.0, 1, True), (3.0, 2, True)]
    path.write_bytes(path.read_bytes()[:-6])  # the writer is in the middle of the last record
    assert read_events(path) == [(1.0, 0, False), (2.0, 1, True)]


def test_attempts_come_from_the_event_files_in_start_order(tmp_path):
    attempt_file(tmp_path, "200.host.2.0", 200.0, [(4, 230.0), (5, 260.0)])
    attempt_file(tmp_path, "100.host.1.0", 100.0, [(1, 110.0), (2, 120.0), (3, 130.0), (4, 140.0)])
    write_events(tmp_path / "tensorboard" / "events.out.tfevents.300.host.3.0", [])  # empty: no attempt
    assert read_attempts(tmp_path) == [Attempt("events.out.tfevents.100.host.1.0", 100.0, 140.0, 1, 4),
                                       Attempt("events.out.tfevents.200.host.2.0", 200.0, 260.0, 4, 5)]


def test_the_event_files_torch_writes_are_read(tmp_path):
    from torch.utils.tensorboard import SummaryWriter
    w = SummaryWriter(log_dir=str(tmp_path / "tensorboard"))
    for step in (1, 2, 3):
        w.add_scalar("loss", 1.0 / step, step)
    w.close()
    [a] = read_attempts(tmp_path)
    assert (a.first_step, a.last_step) == (1, 3) and 0 <= a.seconds < 60


# -- the numbers --------------------------------------------------------------------------------------------

def test_phase_split_maps_the_timers_to_the_five_phases():
    row = rl_row(1, 0.5)
    # generation 3; log-probs and reward: (4 - 3) scoring + 1 infer; training 4; sync 0.5; other 10 - 9.5
    assert phase_split(row) == {"generation": 3.0, "weight sync": 0.5, "log-probs and reward": 2.0,
                                "training": 4.0, "other": 0.5}
    # async / rollout elsewhere: the leader's generation (6 s) exceeds rank 0's wait (4 s): the wait counts
    assert phase_split({**row, "time/rollout_generate_s": 6.0})["generation"] == 4.0
    assert phase_split({**row, "time/rollout_generate_s": 6.0})["log-probs and reward"] == 1.0
    # generation not timed apart: the whole collect
    no_gen = {k: v for k, v in row.items() if k != "time/rollout_generate_s"}
    assert phase_split(no_gen)["generation"] == 4.0 and phase_split(no_gen)["log-probs and reward"] == 1.0
    # the actor leader waited 0.3 s of its 0.5 s sync for the rollout ranks (still generating): generation 3.3,
    # weight sync 0.2; a wait above the sync time (clock skew) counts at most the sync
    waited = phase_split({**row, "time/weight_sync_wait_s": 0.3})
    assert waited["generation"] == pytest.approx(3.3) and waited["weight sync"] == pytest.approx(0.2)
    assert phase_split({**row, "time/weight_sync_wait_s": 0.7})["weight sync"] == 0.0
    # the receipt after the sync (0.25 s) is part of it: 0.5 + 0.25, taken from what was other (0.5 - 0.25)
    receipt = phase_split({**row, "time/sync_receipt_s": 0.25})
    assert receipt["weight sync"] == 0.75 and receipt["other"] == 0.25
    # timed parts above the step time: other is 0, not negative
    assert phase_split({**row, "time/step_s": 9.0})["other"] == 0.0
    assert phase_split({"step": 1, "loss": 1.0}) is None


def test_phase_totals_and_shares():
    rows = [rl_row(1, 0.5), rl_row(2, 0.5, **{"time/step_s": 12.0}), {"step": 3, "eval/pass@1": 0.5}]
    totals = phase_totals(rows)
    assert totals == {"generation": 6.0, "weight sync": 1.0, "log-probs and reward": 4.0, "training": 8.0,
                      "other": 3.0}  # other: 0.5 + 2.5
    assert shares(totals) == {"generation": 6 / 22, "weight sync": 1 / 22, "log-probs and reward": 4 / 22,
                              "training": 8 / 22, "other": 3 / 22}
    assert shares({}) == {} and shares({"other": 0.0}) == {}


def test_final_and_best():
    steps, values = [1, 2, 3, 4], [0.5, 0.8, 0.8, 0.6]
    assert final_and_best(steps, values, "max") == {"final": 0.6, "final_step": 4, "best": 0.8, "best_step": 2}
    assert final_and_best(steps, values, "min") == {"final": 0.6, "final_step": 4, "best": 0.5, "best_step": 1}
    assert final_and_best(steps, values, None) == {"final": 0.6, "final_step": 4}
    assert final_and_best([], [], "max") == {}


@pytest.mark.parametrize("key, want", [("reward/mean", "max"), ("eval/pass@4", "max"), ("eval/maj@8", "max"),
                                       ("eval/avg@8", "max"), ("eval/reward_mean", "max"), ("eval_accuracy", "max"),
                                       ("loss", "min"), ("eval_loss", "min"), ("critic/loss", "min"),
                                       ("eval_nll", "min"), ("response_length/truncated", "min"),
                                       ("actor/loss", None), ("kl", None), ("response_length/mean", None),
                                       ("eval_margin", None)])
def test_direction_of_a_metric(key, want):
    assert direction(key) == want


def test_eval_keys_pick_and_order_the_eval_curves():
    keys = {"eval/pass@1", "eval/pass@16", "eval/pass@4", "eval/maj@4", "eval/avg@16", "eval/reward_mean",
            "eval/prompts", "eval/left_out@4", "eval/gsm/pass@1", "eval_gsm_pass1", "time/eval_s", "reward/mean"}
    assert eval_keys(keys, "rl") == ["eval/pass@1", "eval/pass@4", "eval/pass@16", "eval/maj@4", "eval/avg@16",
                                     "eval/reward_mean"]
    assert eval_keys({"loss", "eval_loss", "eval_accuracy", "eval_margin", "accuracy"}, "offline") == \
        ["eval_accuracy", "eval_margin"]


def test_running_mean_and_its_window():
    assert running_mean([1.0, 2.0, 3.0, 4.0, 5.0], 1) == [1.5, 2.0, 3.0, 4.0, 4.5]
    assert running_mean([1.0, 2.0, 3.0, 4.0, 8.0], 2) == [2.0, 2.5, 3.6, 4.25, 5.0]
    assert running_mean([4.0, 2.0], 0) == [4.0, 2.0]
    assert (smoothing_half_width(60), smoothing_half_width(61), smoothing_half_width(200)) == (0, 1, 5)


def test_a_panel_shows_the_runs_of_its_trainer_only(tmp_path):
    # KTO logs "kl" too, in another sense and over optimizer steps: not in the RL chart of the KL
    kto = load_run(write_rows(tmp_path / "kto" / "metrics.jsonl", [{"step": 1, "loss": 0.5, "kl": 0.2}]).parent)
    rl = load_run(write_rows(tmp_path / "rl" / "metrics.jsonl", [rl_row(1, 0.5)]).parent)
    kl = next(c for c in charts([kto, rl]) if c.name == "kl").panels[0]
    assert (kto.kind, rl.kind) == ("offline", "rl")
    assert not has_data(kl, [kto]) and has_data(kl, [kto, rl])


def test_throughput_of_the_offline_trainers(tmp_path):
    sft = load_run(write_rows(tmp_path / "sft" / "metrics.jsonl", [
        {"step": 1, "loss": 2.0, "tokens": 400.0, "step_time_s": 0.2},
        {"step": 2, "loss": 1.0, "tokens": 300.0, "step_time_s": 0.5}, {"step": 2, "eval_loss": 1.1}]).parent)
    assert series(sft, "tokens_per_s") == ([1, 2], [2000.0, 600.0]) and series(sft, "samples_per_s") == ([], [])
    dpo = write_rows(tmp_path / "dpo" / "metrics.jsonl", [{"step": 10, "loss": 0.6, "step_time_s": 0.5},
                                                          {"step": 20, "loss": 0.5, "step_time_s": 0.25}]).parent
    assert series(load_run(dpo), "samples_per_s") == ([], [])  # the batch size comes from the config
    (dpo / "hpc_rlhf_config.yaml").write_text(yaml.safe_dump({"train": {"train_batch_size": 32}}))
    assert series(load_run(dpo), "samples_per_s") == ([10, 20], [64.0, 128.0])


def test_run_labels_tell_runs_apart(tmp_path):
    a, b, c = tmp_path / "x" / "ckpt" / "model", tmp_path / "y" / "ckpt" / "model", tmp_path / "grpo"
    assert run_labels([c]) == ["grpo"]
    assert run_labels([a, b]) == ["x/ckpt/model", "y/ckpt/model"]
    assert run_labels([a, c]) == ["model", "grpo"]
    with pytest.raises(ReportError, match="given twice"):
        run_labels([c, tmp_path / "." / "grpo"])


def test_wall_time_from_the_attempts_else_from_step_times(tmp_path):
    write_rows(tmp_path / "run" / "metrics.jsonl", [rl_row(2, 0.5), rl_row(4, 0.6, **{"time/step_s": 14.0}),
                                                    {"step": 4, "time/eval_s": 5.0}])
    run = load_run(tmp_path / "run")
    # logged every 2 steps: mean step time 12 s x 4 steps + 5 s of eval
    assert wall_seconds(run) == (53.0, "step times")
    attempt_file(tmp_path / "run", "1.h.1.0", 100.0, [(2, 130.0)])
    attempt_file(tmp_path / "run", "2.h.2.0", 500.0, [(4, 520.0)])
    assert wall_seconds(load_run(tmp_path / "run")) == (50.0, "events")


# -- a run folder -------------------------------------------------------------------------------------------

def test_load_run_errors_name_the_folder(tmp_path):
    with pytest.raises(ReportError, match=re.escape(f"{tmp_path / 'nope'}: no such folder")):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="has no metrics.jsonl: give the run's ckpt.save_path"):
        load_run(tmp_path / "empty")


def _checkpoint(ckpt: Path, step: int, config: dict) -> None:
    folder = ckpt / f"global_step{step}"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "COMMITTED").write_text(f"{step}\n")


def test_a_running_run_takes_its_config_from_its_newest_checkpoint(tmp_path):
    run_dir = tmp_path / "work" / "ckpt" / "grpo"
    write_rows(run_dir / "metrics.jsonl", [rl_row(1, 0.5), rl_row(2, 0.6)])
    config = {"ckpt": {"save_path": "./ckpt/grpo", "ckpt_path": "./ckpt/grpo_checkpoints"},
              "rollout": {"n_samples_per_prompt": 4}, "algo": {"advantage_estimator": "rloo"},
              "train": {"max_steps": 10}}
    _checkpoint(tmp_path / "work" / "ckpt" / "grpo_checkpoints", 1, config)
    _checkpoint(tmp_path / "work" / "ckpt" / "grpo_checkpoints", 2, config)
    (tmp_path / "work" / "ckpt" / "grpo_checkpoints" / "global_step3").mkdir()  # not committed
    run = load_run(run_dir)
    assert run.config == config and run.checkpoints == [1, 2] and not run.exported
    s = summarize(run)
    assert (s["algorithm"], s["last_step"], s["max_steps"]) == ("rloo", 2, 10)
    # finished: the exported config names the checkpoint folder, relative to where the run started
    (run_dir / "hpc_rlhf_config.yaml").write_text(yaml.safe_dump({**config, "ckpt": {
        "save_path": "ckpt/grpo", "ckpt_path": "elsewhere/ck"}}))
    _checkpoint(tmp_path / "work" / "elsewhere" / "ck", 7, config)
    run = load_run(run_dir)
    assert run.exported and run.ckpt_path == tmp_path / "work" / "elsewhere" / "ck" and run.checkpoints == [7]


def test_a_checkpoint_folder_of_another_run_is_not_taken(tmp_path):
    write_rows(tmp_path / "a" / "metrics.jsonl", [{"step": 1, "loss": 1.0, "step_time_s": 0.5}])
    _checkpoint(tmp_path / "a_ckpt", 4, {"ckpt": {"save_path": str(tmp_path / "b")}})
    run = load_run(tmp_path / "a")
    assert run.config is None and run.checkpoints == [] and run.kind == "offline"


def _resumed_rl_run(root: Path) -> Path:
    """An RL run with eval every 2 steps, resumed once from the checkpoint of step 2, its second attempt
    still writing step 4's row."""
    run = root / "grpo"
    first = [rl_row(1, 0.2), rl_row(2, 0.4, **{"eval/pass@1": 0.3, "eval/pass@4": 0.5, "time/eval_s": 2.0}),
             rl_row(3, 0.9)]  # step 3 was lost with the first attempt...
    write_rows(run / "metrics.old-1.jsonl", first)
    second = [rl_row(3, 0.5), rl_row(4, 0.55, **{"eval/pass@1": 0.35, "eval/pass@4": 0.6, "time/eval_s": 2.0})]
    write_rows(run / "metrics.jsonl", first[:2] + second[:1], tail=json.dumps(second[1])[:40])
    attempt_file(run, "1000.h.1.0", 1000.0, [(1, 1010.0), (2, 1022.0), (3, 1032.0)])
    attempt_file(run, "2000.h.2.0", 2000.0, [(3, 2015.0)])
    (run / "hpc_rlhf_config.yaml").write_text(yaml.safe_dump({"rollout": {}, "algo": {"advantage_estimator":
                                                              "group_norm"}, "train": {"max_steps": 6}}))
    return run


def _sft_run(root: Path) -> Path:
    rows = [{"step": s, "loss": 2.0 / s, "tokens": 400.0, "lr": 1e-4 * s / 80, "grad_norm": 1.0,
             "step_time_s": 0.2, **({"eval_loss": 2.2 / s} if s % 20 == 0 else {})} for s in range(1, 81)]
    return write_rows(root / "sft" / "metrics.jsonl", rows).parent


def _plain_rl_run(root: Path) -> Path:
    return write_rows(root / "rloo" / "metrics.jsonl",
                      [rl_row(s, 0.1 * s, **{"critic/loss": 1.0 / s, "critic/grad_norm": 0.5}) for s in (1, 2, 3)]
                      ).parent


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return struct.unpack(">II", data[16:24])


def test_report_of_a_resumed_run_a_run_without_eval_and_an_sft_run(tmp_path):
    runs = [_resumed_rl_run(tmp_path), _plain_rl_run(tmp_path), _sft_run(tmp_path)]
    out = tmp_path / "report"
    out.mkdir()
    (out / "entropy.png").write_bytes(b"stale")  # from an earlier report of other runs
    rep = write_report(runs, out)
    names = [n for n, _ in rep.images]
    assert names == ["reward.png", "eval.png", "kl.png", "losses.png", "response.png", "step_time.png",
                     "step_time_share.png", "loss.png", "throughput.png", "learning_rate.png", "grad_norm.png"]
    assert rep.missing == ["entropy"] and not (out / "entropy.png").exists()
    for name in names:
        w, h = _png_size(out / name)
        assert 300 <= w <= 1500 and 200 <= h <= 1000, (name, w, h)
    # report.html: every chart inline, nothing loaded from elsewhere
    page = (out / "report.html").read_text()
    inline = re.findall(r"src='data:image/png;base64,([^']+)'", page)
    assert [base64.b64decode(x) for x in inline] == [(out / n).read_bytes() for n in names]
    assert not re.search(r"src=['\"](?!data:)", page) and "<link" not in page
    assert "policy entropy (logged when algo.entropy_loss_coef &gt; 0 or algo.log_entropy)" in page
    assert "(set aside, not shown): metrics.old-1.jsonl</li>" in page and "time in evals: 2.0 s</li>" in page

    grpo, rloo, sft = rep.summaries
    # the resumed run: rows 1, 2 (first attempt) and 3 (second attempt); step 4 is half written
    assert grpo["last_step"] == 3 and grpo["partial_line"] and grpo["resumes"] == 1
    assert grpo["attempt_starts"] == [1, 3] and grpo["set_aside"] == ["metrics.old-1.jsonl"]
    assert grpo["wall_s"] == 32.0 + 15.0 and grpo["eval_s"] == 2.0
    assert grpo["metrics"]["reward/mean"] == {"final": 0.5, "final_step": 3, "best": 0.5, "best_step": 3}
    assert grpo["metrics"]["eval/pass@4"] == {"final": 0.5, "final_step": 2, "best": 0.5, "best_step": 2}
    assert grpo["phase_shares"]["training"] == pytest.approx(0.4)  # 3 x 4 s of 3 x 10 s
    assert rloo["attempts"] == 0 and "eval/pass@1" not in rloo["metrics"]
    assert rloo["metrics"]["critic/loss"] == {"final": 1 / 3, "final_step": 3, "best": 1 / 3, "best_step": 3}
    assert sft["kind"] == "offline" and sft["phase_seconds"] == {}
    assert sft["metrics"]["eval_loss"] == {"final": 2.2 / 80, "final_step": 80, "best": 2.2 / 80, "best_step": 80}
    assert sft["wall_s"] == pytest.approx(0.2 * 80)

    md = (out / "summary.md").read_text()
    assert "| grpo | rl (group_norm) | 3 (max_steps 6) | 47.0 s | 1 (attempts' first logged steps: 1, 3) |" in md
    assert "| rloo | rl | 3 | 30.0 s (≈, from step times) | unknown (no TensorBoard events) |" in md
    assert "| reward/mean | 0.5 | 3 | 0.5 | 3 |" in md and "| eval/pass@1 | 0.3 | 2 | 0.3 | 2 |" in md
    assert "| training | 40.0 % | 4 |" in md and "| other | 5.0 % | 0.5 |" in md
    assert ("rows an attempt logged past the checkpoint a later one resumed from (set aside, not shown): "
            "metrics.old-1.jsonl") in md


def test_report_of_runs_without_rows_yet(tmp_path):
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "metrics.jsonl").write_text("")
    rep = write_report([tmp_path / "new"], tmp_path / "out")
    assert rep.images == [] and "No metrics logged yet." in (tmp_path / "out" / "summary.md").read_text()


def _report_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_report_args(parser)
    return report(parser.parse_args(argv))


def test_the_command_prints_what_it_wrote_and_fails_with_one_line(tmp_path, capsys):
    run = write_rows(tmp_path / "dpo" / "metrics.jsonl", [{"step": 1, "loss": 0.7}, {"step": 2, "loss": 0.6}]).parent
    assert _report_cli(str(run), "--out", str(tmp_path / "out")) == 0
    assert capsys.readouterr().out == f"wrote 1 chart, report.html and summary.md to {tmp_path / 'out'}\n"
    assert _report_cli(str(tmp_path / "missing"), "--out", str(tmp_path / "out")) == 2
    assert capsys.readouterr().err == f"hpc-rlhf report: {tmp_path / 'missing'}: no such folder\n"
    (tmp_path / "file").write_text("")
    assert _report_cli(str(run), "--out", str(tmp_path / "file")) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_matplotlib_is_a_declared_dependency():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"matplotlib\b", d) for d in deps)


@pytest.mark.slow  # a real train rl run (50-130 s on a busy machine)
def test_report_of_a_real_tiny_rl_run(tmp_path):
    """`train rl` for 3 steps with an eval every 2 (pass@k), then `hpc-rlhf report` on its folder."""
    from rl_fixtures import make_assets, merged, run_rl
    base = make_assets(tmp_path)
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text("".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(4)))
    config = merged(base, data={"eval_prompt_data": [str(eval_data)]},
                    eval={"eval_n_samples_per_prompt": 2, "eval_temperature": 1.0, "correct_threshold": 0.5,
                          "best_metric": "eval/pass@1"}, log={"eval_steps": 2, "check_weight_sync": False},
                    train={"max_steps": 3})
    rows = run_rl(config, tmp_path, "run")
    args = build_parser().parse_args(["report", str(tmp_path / "run"), "--out", str(tmp_path / "out")])
    assert args.func(args, []) == 0  # `hpc-rlhf report RUN_DIR --out DIR`, in this process
    out = tmp_path / "out"
    for name in ("reward", "eval", "kl", "losses", "response", "step_time", "step_time_share", "learning_rate",
                 "grad_norm"):
        assert _png_size(out / f"{name}.png")[0] > 300
    s = summarize(load_run(tmp_path / "run"))
    assert s["last_step"] == 3 and s["attempts"] == 1 and s["exported"] and s["algorithm"] == "group_norm"
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert s["metrics"]["reward/mean"]["final"] == rewards[-1] and s["metrics"]["reward/mean"]["best"] == max(rewards)
    assert [r["step"] for r in rows if "eval/pass@2" in r] == [2, 3]
    assert s["metrics"]["eval/pass@2"]["final_step"] == 3
    assert s["best_model"]["metric"] == "eval/pass@1" and s["best_model"]["step"] in (2, 3)
    assert sum(s["phase_shares"].values()) == pytest.approx(1.0)
    md = (out / "summary.md").read_text()
    assert "| run | rl (group_norm) | 3 (max_steps 3) |" in md
