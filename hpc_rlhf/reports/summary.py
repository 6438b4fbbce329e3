"""The numbers of a report: the step time split by phase, final and best values, and the summary table.

The phases of an RL step, from the timers of ``trainers/rl.py``, ``trainers/rl_collect.py`` and
``roles/sync.py`` (seconds, measured on global rank 0, whose row is logged):

- generation: ``time/rollout_generate_s``, the rollout leader's last generate call, capped at
  ``time/generate_score_s`` (with the rollout on ranks of its own, rank 0 waits for it inside the collect;
  under ``train.async_train`` the leader's call is the next step's, made while this one trained, and only
  the wait counts); ``time/generate_score_s`` itself when the generation was not timed apart;
- log-probs and reward: the rest of ``time/generate_score_s`` (scoring, the exchanges, dynamic filtering's
  extra rounds) plus ``time/infer_advantages_s`` (reference, critic and old-policy passes, advantages);
- training: ``time/train_s`` (actor and critic updates);
- weight sync: ``time/weight_sync_s`` less ``time/weight_sync_wait_s``, the actor leader's wait for rollout
  ranks of their own to join the broadcast, which counts as generation (under ``train.async_train`` they are
  still generating the next step's samples), plus ``time/sync_receipt_s``, the sync's receipt;
- other: the rest of ``time/step_s`` (the commit's metrics exchange, and whatever the timers leave out).

The eval (``time/eval_s``) and checkpoints happen outside ``time/step_s``: they are not among the phases.
"""
from __future__ import annotations

import time

from .runs import Run

PHASES = ("generation", "weight sync", "log-probs and reward", "training", "other")
EVAL_PREFIXES = ("pass@", "maj@", "avg@")


def phase_split(row: dict) -> dict[str, float] | None:
    """The seconds of each phase of one RL step's row (see the module's docstring), or None when the row has
    no ``time/step_s``.  The phases add up to ``time/step_s`` unless the timed parts exceed it (then "other"
    is 0)."""
    total = row.get("time/step_s")
    if not isinstance(total, (int, float)):
        return None
    collect = float(row.get("time/generate_score_s", 0.0))
    generation = min(float(row.get("time/rollout_generate_s", collect)), collect)
    sync = float(row.get("time/weight_sync_s", 0.0))
    wait = min(float(row.get("time/weight_sync_wait_s", 0.0)), sync)
    parts = {"generation": generation + wait,
             "weight sync": sync - wait + float(row.get("time/sync_receipt_s", 0.0)),
             "log-probs and reward": collect - generation + float(row.get("time/infer_advantages_s", 0.0)),
             "training": float(row.get("time/train_s", 0.0))}
    parts["other"] = max(float(total) - sum(parts.values()), 0.0)
    return parts


def phase_totals(rows: list[dict]) -> dict[str, float]:
    """Seconds per phase summed over the rows that have a step time ({} when none has)."""
    totals: dict[str, float] = {}
    for row in rows:
        split = phase_split(row)
        for k, v in (split or {}).items():
            totals[k] = totals.get(k, 0.0) + v
    return totals


def shares(totals: dict[str, float]) -> dict[str, float]:
    """Each phase's fraction of the summed time ({} when the sum is 0)."""
    s = sum(totals.values())
    return {k: v / s for k, v in totals.items()} if s > 0 else {}


def direction(key: str) -> str | None:
    """"max" when a larger value is better (rewards, accuracies, pass@k, maj@k, avg@n), "min" when a smaller
    one is (losses, NLL, truncated or invalid fractions), None when neither (KL, lengths, learning rate, the
    actor's surrogate loss)."""
    name = key.rsplit("/", 1)[-1].removeprefix("eval_")
    if key == "actor/loss":  # a policy-gradient surrogate: its level says nothing of the policy
        return None
    if "loss" in name or name in ("nll", "truncated", "invalid"):
        return "min"
    if name.startswith(EVAL_PREFIXES) or "accuracy" in name or key == "reward/mean" or name == "reward_mean":
        return "max"
    return None


def final_and_best(steps: list[int], values: list[float], mode: str | None) -> dict:
    """{"final", "final_step"} and, when ``mode`` is "max" or "min", {"best", "best_step"}: the first step that
    reached the best value.  Empty series: {}."""
    if not values:
        return {}
    out = {"final": values[-1], "final_step": steps[-1]}
    if mode in ("max", "min"):
        sign = 1.0 if mode == "max" else -1.0
        i = max(range(len(values)), key=lambda j: (sign * values[j], -j))
        out.update(best=values[i], best_step=steps[i])
    return out


def eval_keys(keys: set[str], kind: str) -> list[str]:
    """The eval metrics worth a curve, in a fixed order: RL's ``eval/pass@k``, ``eval/maj@k``, ``eval/avg@n``
    and ``eval/reward_mean`` (whole eval set; the counts and per-dataset copies left out); the offline
    trainers' ``eval_*`` but the loss (which goes with the training loss)."""
    def k_of(key: str) -> int:
        return int(key.rsplit("@", 1)[-1]) if key.rsplit("@", 1)[-1].isdigit() else 0
    if kind == "rl":
        found = [k for k in keys if k.startswith("eval/") and k.count("/") == 1
                 and (k[5:].startswith(EVAL_PREFIXES) or k == "eval/reward_mean")]
        return sorted(found, key=lambda k: (next((i for i, p in enumerate(EVAL_PREFIXES) if k[5:].startswith(p)),
                                                 len(EVAL_PREFIXES)), k_of(k), k))
    return sorted(k for k in keys if k.startswith("eval_") and k != "eval_loss")


def headline_keys(run: Run) -> list[str]:
    """The metrics of the summary table for a run, in order."""
    keys = run.keys()
    if run.kind == "rl":
        first = ["reward/mean"] + eval_keys(keys, "rl") + ["kl", "response_length/mean",
                                                            "response_length/truncated", "actor/loss",
                                                            "critic/loss"]
    else:
        first = ["loss", "eval_loss", "accuracy"] + eval_keys(keys, "offline")
    return [k for k in first if k in keys]


def wall_seconds(run: Run) -> tuple[float | None, str]:
    """The run's wall-clock time and where it comes from: the attempts' TensorBoard events (first to last
    event of each, summed), else the step times (a mean over the logged rows times the steps, plus the
    evals), else None."""
    if run.attempts:
        return sum(a.seconds for a in run.attempts), "events"
    key = "time/step_s" if run.kind == "rl" else "step_time_s"
    steps, values = run.series(key)
    if not values:
        return None, ""
    evals = sum(run.series("time/eval_s")[1])
    return sum(values) / len(values) * steps[-1] + evals, "step times"


def summarize(run: Run) -> dict:
    """The summary of one run: the numbers of summary.md and of the html table."""
    steps = [r["step"] for r in run.rows]
    wall, wall_from = wall_seconds(run)
    out = {"label": run.label, "path": str(run.path), "kind": run.kind,
           "algorithm": run.option("algo", "advantage_estimator") if run.kind == "rl" else None,
           "last_step": steps[-1] if steps else 0, "max_steps": run.option("train", "max_steps"),
           "rows": len(run.rows), "wall_s": wall, "wall_from": wall_from,
           "attempts": len(run.attempts), "resumes": max(len(run.attempts) - 1, 0),
           "attempt_starts": [a.first_step for a in run.attempts],
           "set_aside": list(run.set_aside), "partial_line": run.partial_line,
           "exported": run.exported, "checkpoints": list(run.checkpoints), "best_model": run.best,
           "metrics": {}}
    for key in headline_keys(run):
        out["metrics"][key] = final_and_best(*run.series(key), direction(key))
    totals = phase_totals(run.rows)
    out["phase_seconds"] = totals
    out["phase_shares"] = shares(totals)
    out["eval_s"] = sum(run.series("time/eval_s")[1]) if run.kind == "rl" else None
    return out


# -- rendering ----------------------------------------------------------------------------------------------

def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "—"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(round(s % 60)):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def fmt_value(v: float | None) -> str:
    if v is None:
        return "—"
    if v == 0 or (1e-3 <= abs(v) < 1e5):
        return f"{v:.4g}"
    return f"{v:.3e}"


def _steps_cell(s: dict) -> str:
    text = str(s["last_step"])
    if s["max_steps"]:
        text += f" (max_steps {s['max_steps']})"
    return text


def _state(s: dict) -> str:
    if s["exported"]:
        return "finished (model exported)"
    return "no model exported yet (running, stopped or failed)" + (", last line half-written"
                                                                    if s["partial_line"] else "")


def _resumes(s: dict) -> str:
    if not s["attempts"]:
        return "unknown (no TensorBoard events)" + (f"; {len(s['set_aside'])} set-aside metrics file(s)"
                                                    if s["set_aside"] else "")
    if s["attempts"] == 1:
        return "0"
    starts = ", ".join("?" if f is None else str(f) for f in s["attempt_starts"])
    return f"{s['resumes']} (attempts' first logged steps: {starts})"


def overview_table(summaries: list[dict]) -> list[list[str]]:
    """The comparison table: a header and one row per run."""
    head = ["run", "trainer", "steps", "wall time", "resumes", "state"]
    rows = [[s["label"], s["kind"] + (f" ({s['algorithm']})" if s["algorithm"] else ""), _steps_cell(s),
             fmt_seconds(s["wall_s"]) + (" (≈, from step times)" if s["wall_from"] == "step times" else ""),
             _resumes(s), _state(s)] for s in summaries]
    return [head, *rows]


def metrics_table(s: dict) -> list[list[str]]:
    rows = [["metric", "final", "at step", "best", "at step"]]
    for key, m in s["metrics"].items():
        rows.append([key, fmt_value(m["final"]), str(m["final_step"]),
                     fmt_value(m.get("best")), str(m["best_step"]) if "best_step" in m else "—"])
    return rows


def phase_table(s: dict, steps_logged: int) -> list[list[str]]:
    rows = [["phase", "share of step time", "mean s per step"]]
    for phase in PHASES:
        if phase in s["phase_seconds"]:
            rows.append([phase, f"{100 * s['phase_shares'].get(phase, 0.0):.1f} %",
                         f"{s['phase_seconds'][phase] / max(steps_logged, 1):.3g}"])
    return rows


def markdown_table(rows: list[list[str]]) -> str:
    def cell(x: str) -> str:
        return x.replace("|", "\\|")
    lines = ["| " + " | ".join(cell(c) for c in rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def timed_rows(run: Run) -> int:
    return sum(phase_split(r) is not None for r in run.rows)


def run_notes(s: dict) -> list[str]:
    """The lines under a run's heading: checkpoints, best model, set-aside rows, time in evals."""
    notes = []
    if s["checkpoints"]:
        notes.append(f"committed checkpoints at steps {', '.join(map(str, s['checkpoints']))}")
    if s["best_model"]:
        b = s["best_model"]
        notes.append(f"best model (save_path/best): {b.get('metric')} = {fmt_value(b.get('value'))} "
                     f"at step {b.get('step')}")
    if s["set_aside"]:
        notes.append("rows an attempt logged past the checkpoint a later one resumed from (set aside, not "
                     f"shown): {', '.join(s['set_aside'])}")
    if s["eval_s"]:
        notes.append(f"time in evals: {fmt_seconds(s['eval_s'])}")
    return notes


def summary_markdown(runs: list[Run], summaries: list[dict]) -> str:
    """summary.md: the comparison table, then per run its metrics (final and best) and time per phase."""
    parts = [f"# Run report ({time.strftime('%Y-%m-%d %H:%M')})", "", markdown_table(overview_table(summaries)), ""]
    for run, s in zip(runs, summaries):
        parts += [f"## {s['label']}", "", f"`{s['path']}`", ""]
        extra = run_notes(s)
        parts += [f"- {e}" for e in extra] + ([""] if extra else [])
        if s["metrics"]:
            parts += [markdown_table(metrics_table(s)), ""]
        else:
            parts += ["No metrics logged yet.", ""]
        if s["phase_seconds"]:
            parts += [f"Step time by phase ({timed_rows(run)} logged steps):", "",
                      markdown_table(phase_table(s, timed_rows(run))), ""]
    return "\n".join(parts)
