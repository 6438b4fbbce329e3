"""`hpc-rlhf report RUN_DIR [RUN_DIR ...] --out DIR`: the charts (PNG), report.html (the charts inline, one
file to send around) and summary.md of one or more runs.  Given a sweep folder (`hpc-rlhf sweep`), its runs
are overlaid (a point's seeds in one colour, the points in the legends) and a table compares the points."""
from __future__ import annotations

import base64
import html
import time
from dataclasses import dataclass
from pathlib import Path

from .plots import (STEP_SHARE_CAPTION, STEP_TIME_CAPTION, Chart, charts, draw_chart, draw_step_share,
                    draw_step_time, run_colors)
from .runs import ReportError, Run, load_run, run_labels
from .summary import (markdown_table, metrics_table, overview_table, phase_table, run_notes, summarize,
                      summary_markdown, timed_rows)
from .sweep import Sweep, is_sweep, load_sweep, sweep_notes, sweep_summaries, sweep_table

STEP_TIME = "step_time"
STEP_SHARE = "step_time_share"


@dataclass
class Report:
    out: Path
    images: list[tuple[str, str]]  # (file name, caption) of each chart written, in order
    missing: list[str]  # the charts no run had data for
    summaries: list[dict]
    sweep_rows: list[list[str]] | None = None  # the points' table of a sweep report


def chart_order(chart_list: list[Chart]) -> list[tuple[str, str]]:
    """(name, caption) of every chart in the order of the report: the step-time charts after the RL curves."""
    out = [(c.name, c.caption) for c in chart_list]
    at = next(i for i, (name, _) in enumerate(out) if name == "response") + 1
    return out[:at] + [(STEP_TIME, STEP_TIME_CAPTION), (STEP_SHARE, STEP_SHARE_CAPTION)] + out[at:]


def write_report(run_dirs: list[str | Path], out: str | Path) -> Report:
    """Read the runs, write their charts, report.html and summary.md into ``out``; PNGs of an earlier report
    there that this one does not draw are removed (report.html shows only this one's)."""
    if not run_dirs:
        raise ReportError("no run folder given")
    sweep: Sweep | None = None
    if any(is_sweep(p) for p in run_dirs):
        if len(run_dirs) > 1:
            raise ReportError(f"{next(p for p in run_dirs if is_sweep(p))} is a sweep folder: report it alone")
        sweep = load_sweep(run_dirs[0])
        runs = sweep.runs
        if not runs:
            raise ReportError(f"{run_dirs[0]}: no run of the sweep has logged metrics yet")
    else:
        labels = run_labels([Path(p) for p in run_dirs])
        runs = [load_run(p, label) for p, label in zip(run_dirs, labels)]
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    colors = run_colors(runs)
    chart_list = charts(runs)
    by_name = {c.name: c for c in chart_list}
    images, missing = [], []
    for name, caption in chart_order(chart_list):
        path = out / f"{name}.png"
        if name == STEP_TIME:
            drawn = draw_step_time(runs, path)
        elif name == STEP_SHARE:
            drawn = draw_step_share(runs, path)
        else:
            drawn = draw_chart(by_name[name], runs, colors, path)
        if drawn:
            images.append((path.name, caption))
        else:
            missing.append(name)
            path.unlink(missing_ok=True)
    summaries = [summarize(r) for r in runs]
    text = summary_markdown(runs, summaries)
    sweep_rows = sweep_table(sweep_summaries(sweep)) if sweep is not None else None
    if sweep is not None:  # the points' comparison first, then the runs one by one
        head, rest = text.split("\n", 1)
        notes = "\n".join(f"- {n}" for n in sweep_notes(sweep))
        text = (f"{head}\n\n## Sweep `{sweep.path}`\n\n{notes}\n\n{SWEEP_TABLE_TEXT}\n\n"
                f"{markdown_table(sweep_rows)}\n\n## Runs\n{rest}")
    (out / "summary.md").write_text(text + "\n")
    (out / "report.html").write_text(render_html(runs, summaries, out, images, missing, sweep, sweep_rows))
    return Report(out, images, missing, summaries, sweep_rows)


SWEEP_TABLE_TEXT = ("Per point and metric: the final value (last logged) and the best value (metrics with a "
                    "better direction) of each of the point's runs (its seeds), as mean ± sample standard "
                    "deviation and min – max over the runs.")


MISSING_TEXT = {"eval": "eval metrics (no eval ran: RL needs data.eval_prompt_data, the offline trainers an "
                        "eval split)",
                "entropy": "policy entropy (logged when algo.entropy_loss_coef > 0 or algo.log_entropy)",
                "losses": "actor and critic losses", "kl": "KL", "reward": "reward",
                "response": "response lengths", STEP_TIME: "step time by phase (RL runs only)",
                STEP_SHARE: "step time shares (RL runs only)", "loss": "training loss (offline trainers)",
                "throughput": "throughput (offline trainers)", "learning_rate": "learning rate",
                "grad_norm": "gradient norm"}

CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1400px;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1.2em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f2f2f2}figure{margin:1.5em 0}img{max-width:100%;border:1px solid #eee}
figcaption{color:#555;max-width:900px}code{background:#f4f4f4;padding:0 3px}"""


def _html_table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(runs: list[Run], summaries: list[dict], out: Path, images: list[tuple[str, str]],
                missing: list[str], sweep: Sweep | None = None, sweep_rows: list[list[str]] | None = None) -> str:
    """One self-contained page: the tables of summary.md and every chart as an inline PNG."""
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>hpc_rlhf run report</title>",
             f"<style>{CSS}</style></head><body>", "<h1>Run report</h1>"]
    if sweep is not None:
        parts += [f"<h2>Sweep <code>{html.escape(str(sweep.path))}</code></h2><ul>"]
        parts += [f"<li>{html.escape(n)}</li>" for n in sweep_notes(sweep)]
        parts += [f"</ul><p>{html.escape(SWEEP_TABLE_TEXT)}</p>", _html_table(sweep_rows)]
    parts += [f"<p>{time.strftime('%Y-%m-%d %H:%M')}; runs:</p><ul>"]
    parts += [f"<li><b>{html.escape(s['label'])}</b>: <code>{html.escape(s['path'])}</code></li>" for s in summaries]
    parts += ["</ul><h2>Summary</h2>", _html_table(overview_table(summaries))]
    for run, s in zip(runs, summaries):
        parts.append(f"<h3>{html.escape(s['label'])}</h3>")
        notes = run_notes(s)
        if notes:
            parts.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
        if s["metrics"]:
            parts.append(_html_table(metrics_table(s)))
        if s["phase_seconds"]:
            parts.append(_html_table(phase_table(s, timed_rows(run))))
    parts.append("<h2>Charts</h2>")
    for name, caption in images:
        data = base64.b64encode((out / name).read_bytes()).decode()
        parts.append(f"<figure><img alt='{html.escape(name)}' src='data:image/png;base64,{data}'>"
                     f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    if missing:
        parts.append("<p>Not in these runs: " + "; ".join(html.escape(MISSING_TEXT.get(m, m)) for m in missing)
                     + ".</p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
