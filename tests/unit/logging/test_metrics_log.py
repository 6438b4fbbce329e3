"""metrics.jsonl across runs in one folder: a resume continues it, a fresh run does not mix into it."""
import json

from hpc_rlhf.logging.metrics import MetricsLogger, read_metrics


def _run(root, start, steps):
    m = MetricsLogger(root, enabled=True, use_tensorboard=False, start_step=start)
    for s in steps:
        m.log(s, {"loss": float(s)})
    m.close()


def test_resume_keeps_rows_up_to_its_start_and_sets_aside_the_rest(tmp_path):
    _run(tmp_path, 0, [1, 2, 3, 4, 5])  # killed after step 5; its last checkpoint was at step 3
    _run(tmp_path, 3, [4, 5, 6])
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    old = read_metrics(tmp_path / "metrics.old-1.jsonl")
    assert [r["step"] for r in old] == [1, 2, 3, 4, 5]  # nothing lost


def test_fresh_run_in_a_used_folder_starts_a_new_file(tmp_path):
    _run(tmp_path, 0, [1, 2])
    _run(tmp_path, 0, [1, 2])
    _run(tmp_path, 0, [1])
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]
    assert (tmp_path / "metrics.old-1.jsonl").exists() and (tmp_path / "metrics.old-2.jsonl").exists()


def test_resume_at_the_last_logged_step_only_appends(tmp_path):
    _run(tmp_path, 0, [1, 2])
    _run(tmp_path, 2, [3])
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert not list(tmp_path.glob("metrics.old-*"))
