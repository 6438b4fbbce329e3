"""The report's charts: PNG files drawn with matplotlib's Agg renderer (no display), runs overlaid, each run
one colour in every chart and named in each chart's legend.

matplotlib is imported when the first chart is drawn (``_matplotlib``): every other `hpc-rlhf` command would
otherwise pay its import (about a second) at start-up.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .runs import Run
from .summary import PHASES, eval_keys, phase_split

RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
              "#7f7f7f", "#bcbd22")
PHASE_COLORS = {"generation": "#4c72b0", "weight sync": "#dd8452", "log-probs and reward": "#55a868",
                "training": "#c44e52", "other": "#b3b3b3"}
SMOOTH_ABOVE = 60  # a series with more points is drawn faint, under its running mean
DPI = 100


@dataclass(frozen=True)
class Panel:
    key: str  # the metric (or a derived one: see ``series``)
    title: str
    ylabel: str
    kind: str = "rl"  # the runs it shows: "rl" (`train rl`) or "offline" (a key may mean another thing there)
    scale: float = 1.0  # values are multiplied by it (fractions shown in %)
    eval_key: str | None = None  # its eval counterpart, drawn dashed with markers in the same panel
    smooth: bool = True  # a long noisy series gets a running mean (not a schedule such as the learning rate)
    from_zero: bool = False  # a quantity that cannot be negative: the y axis starts at 0
    unit_range: bool = False  # a fraction: the y axis spans 0 to 1 (curves of runs compare at a glance)


@dataclass(frozen=True)
class Chart:
    name: str  # the PNG's file stem
    caption: str
    panels: tuple[Panel, ...]


XLABEL = {"rl": "RL step", "offline": "optimizer step"}
OFFLINE = "offline"


def running_mean(values: list[float], half: int) -> list[float]:
    """Centred running mean: point i is the mean of values i - half .. i + half (those that exist)."""
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    n = len(values)
    return [(prefix[min(i + half + 1, n)] - prefix[max(i - half, 0)]) / (min(i + half + 1, n) - max(i - half, 0))
            for i in range(n)]


def smoothing_half_width(n: int) -> int:
    """The running mean's half width for a series of n points: 0 (none) up to SMOOTH_ABOVE points, else n // 40
    (at least 1): a window of about a twentieth of the points."""
    return 0 if n <= SMOOTH_ABOVE else max(1, n // 40)


def series(run: Run, key: str) -> tuple[list[int], list[float]]:
    """A metric's steps and values; two derived ones: ``tokens_per_s`` (SFT's loss tokens of a step over its
    time) and ``samples_per_s`` (train.train_batch_size over the step time, for the other offline trainers)."""
    if key == "tokens_per_s":
        rows = [r for r in run.rows if _num(r.get("tokens")) and _num(r.get("step_time_s")) and r["step_time_s"] > 0]
        return [r["step"] for r in rows], [r["tokens"] / r["step_time_s"] for r in rows]
    if key == "samples_per_s":
        batch = run.option("train", "train_batch_size")
        if "tokens" in run.keys() or not _num(batch):
            return [], []
        steps, times = run.series("step_time_s")
        pairs = [(s, batch / t) for s, t in zip(steps, times) if t > 0]
        return [s for s, _ in pairs], [v for _, v in pairs]
    return run.series(key)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# -- the charts ---------------------------------------------------------------------------------------------

_EVAL_TEXT = {"pass@": ("pass@{k}", "fraction of eval prompts"), "maj@": ("maj@{k}", "fraction of eval prompts"),
              "avg@": ("avg@{k}", "mean reward per prompt")}


def _rl_eval_panel(key: str) -> Panel:
    name = key[len("eval/"):]
    for prefix, (title, ylabel) in _EVAL_TEXT.items():
        if name.startswith(prefix):
            return Panel(key, "Eval " + title.format(k=name[len(prefix):]), ylabel,
                         unit_range=prefix in ("pass@", "maj@"))
    return Panel(key, "Eval reward (mean over samples)", "reward")


def offline_ylabel(name: str) -> str:
    """The y label of an offline trainer's metric (its eval_ twin shares it)."""
    if "accuracy" in name:
        return "fraction of eval items right"
    if name == "nll":
        return "NLL (nats per token)"
    if "margin" in name:
        return "reward margin (nats)"
    if "reward" in name:
        return "implicit reward (nats)" if name.startswith(("chosen", "rejected")) else "reward"
    if "kl" in name:
        return "KL (nats)"
    return name.replace("_", " ")


def eval_chart(runs: list[Run]) -> Chart:
    """The eval metrics present in any run: RL's eval/* (pass@k, maj@k, avg@n, reward mean); the offline
    trainers' eval_* (the training value beside it, when logged)."""
    def keys_of(kind: str) -> set[str]:
        return set().union(set(), *(r.keys() for r in runs if r.kind == kind))
    panels = [_rl_eval_panel(k) for k in eval_keys(keys_of("rl"), "rl")]
    for k in eval_keys(keys_of("offline"), "offline"):
        name = k[len("eval_"):]
        panels.append(Panel(name, f"{name.replace('_', ' ')} (solid: training, dashed: eval)", offline_ylabel(name),
                            OFFLINE, eval_key=k))
    return Chart("eval", "Eval metrics at each eval (RL: n samples per eval prompt, docs/eval.md; offline "
                         "trainers: the eval split, beside the training value).", tuple(panels))


def charts(runs: list[Run]) -> list[Chart]:
    """Every chart of a report, in the order the html shows them (those without data are left out later)."""
    return [
        Chart("reward", "Mean reward of the training samples of each RL step (`reward/mean`).",
              (Panel("reward/mean", "Reward of the training samples", "reward (mean of the step)"),)),
        eval_chart(runs),
        Chart("kl", "KL between the policy and the reference on the training samples (`kl`: the estimator's "
                    "mean per response token).",
              (Panel("kl", "KL to the reference", "KL (nats per token)"),)),
        Chart("losses", "Actor and critic losses (`actor/loss`, `critic/loss`, means over the step's updates).",
              (Panel("actor/loss", "Actor (policy) loss", "loss per token"),
               Panel("critic/loss", "Critic (value) loss", "loss per token"))),
        Chart("entropy", "Entropy of the policy on the training samples (`actor/entropy`; logged when "
                         "algo.entropy_loss_coef > 0 or algo.log_entropy is set).",
              (Panel("actor/entropy", "Policy entropy", "entropy (nats per token)", from_zero=True),)),
        Chart("response", "Response length and the share of responses cut by the length limit "
                          "(`response_length/mean`, `response_length/truncated`).",
              (Panel("response_length/mean", "Response length", "tokens (mean per sample)", from_zero=True),
               Panel("response_length/truncated", "Truncated responses", "% of samples", scale=100.0,
                     from_zero=True))),
        Chart("loss", "Training loss of the offline trainers (`loss`, solid) and eval loss (`eval_loss`, dashed).",
              (Panel("loss", "Training loss (solid) and eval loss (dashed)", "loss (nats)", OFFLINE,
                     eval_key="eval_loss"),)),
        Chart("throughput", "Throughput of the offline trainers: SFT's loss tokens per second, the others' "
                            "items (train.train_batch_size) per second.",
              (Panel("tokens_per_s", "SFT throughput", "loss tokens / s", OFFLINE, from_zero=True),
               Panel("samples_per_s", "Throughput", "items / s", OFFLINE, from_zero=True))),
        Chart("learning_rate", "Learning rate at each step (`actor/lr`; `lr` for the offline trainers).",
              (Panel("actor/lr", "Actor learning rate", "learning rate", smooth=False, from_zero=True),
               Panel("lr", "Learning rate", "learning rate", OFFLINE, smooth=False, from_zero=True))),
        Chart("grad_norm", "Global gradient norm of each optimizer step (`actor/grad_norm`, `critic/grad_norm`, "
                           "`grad_norm`).",
              (Panel("actor/grad_norm", "Actor gradient norm", "L2 norm", from_zero=True),
               Panel("critic/grad_norm", "Critic gradient norm", "L2 norm", from_zero=True),
               Panel("grad_norm", "Gradient norm", "L2 norm", OFFLINE, from_zero=True))),
    ]


STEP_TIME_CAPTION = ("Time of each RL step by phase, stacked (seconds, measured on rank 0): generation, weight "
                     "sync, log-probs and reward (scoring, reference/critic/old-policy passes, advantages), "
                     "training, other (the rest of `time/step_s`). Evals and checkpoints are not part of a step.")
STEP_SHARE_CAPTION = "Mean seconds per RL step by phase, one bar per run, with each phase's share of the step."


def has_data(panel: Panel, runs: list[Run]) -> bool:
    return any(series(r, panel.key)[0] or (panel.eval_key and r.series(panel.eval_key)[0])
               for r in runs if r.kind == panel.kind)


# -- drawing ------------------------------------------------------------------------------------------------

def _matplotlib():
    """matplotlib's Figure and the Agg canvas (imported here: see the module's docstring)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    return Figure, FigureCanvasAgg, Line2D


def _figure(n_panels: int, extra_height: float = 0.0):
    Figure, FigureCanvasAgg, _ = _matplotlib()
    cols = min(n_panels, 3)
    rows = -(-n_panels // cols)
    fig = Figure(figsize=(0.6 + 4.4 * cols, 0.9 + 3.1 * rows + extra_height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes[:n_panels]


def _style(ax, panel_title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(panel_title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
    ax.xaxis.get_major_locator().set_params(integer=True)


def _widen_steps(ax) -> None:
    """A step axis spanning under two steps (one point, say) is widened to three: integer ticks only."""
    lo, hi = ax.dataLim.intervalx
    if hi - lo < 2:
        ax.set_xlim(lo - 1, hi + 1)


def _plot_line(ax, steps, values, color, dashed: bool, smooth: bool = True) -> None:
    n = len(values)
    if dashed:  # eval points: few, each one an eval
        ax.plot(steps, values, color=color, linestyle="--", marker="s", markersize=4, linewidth=1.4)
        return
    half = smoothing_half_width(n) if smooth else 0
    if half:
        ax.plot(steps, values, color=color, linewidth=0.8, alpha=0.25)
        ax.plot(steps, running_mean(values, half), color=color, linewidth=1.8)
    else:
        ax.plot(steps, values, color=color, linewidth=1.6, marker="o" if n <= 30 else None, markersize=3)


def _legend(fig, runs: list[Run], colors: dict[str, str], styles: bool) -> None:
    _, _, Line2D = _matplotlib()
    first = {}  # one entry per group (a sweep point: its seeds share the colour), else per run
    for r in runs:
        first.setdefault(r.group or r.label, r)
    handles = [Line2D([], [], color=colors[r.label], linewidth=2) for r in first.values()]
    labels = list(first)
    if styles:
        handles += [Line2D([], [], color="black", linewidth=1.6), Line2D([], [], color="black", linestyle="--",
                                                                           marker="s", markersize=4)]
        labels += ["training", "eval"]
    fig.legend(handles, labels, loc="outside lower center", frameon=False, fontsize=10,
               ncols=legend_columns(labels, fig.get_figwidth()))


def legend_columns(labels: list[str], width_in: float) -> int:
    """As many legend entries side by side as fit the figure's width (a guess from the labels' length)."""
    per_entry = 0.75 + 0.085 * max(len(x) for x in labels)
    return max(1, min(len(labels), int(width_in // per_entry)))


def draw_chart(chart: Chart, runs: list[Run], colors: dict[str, str], path: Path) -> bool:
    """Draw the panels of ``chart`` that have data into ``path``; False (nothing written) when none has."""
    panels = [p for p in chart.panels if has_data(p, runs)]
    if not panels:
        return False
    fig, axes = _figure(len(panels))
    shown: list[Run] = []
    for ax, panel in zip(axes, panels):
        for run in (r for r in runs if r.kind == panel.kind):
            steps, values = series(run, panel.key)
            drawn = False
            if steps:
                _plot_line(ax, steps, [v * panel.scale for v in values], colors[run.label], dashed=False,
                           smooth=panel.smooth)
                drawn = True
            if panel.eval_key:
                e_steps, e_values = run.series(panel.eval_key)
                if e_steps:
                    _plot_line(ax, e_steps, [v * panel.scale for v in e_values], colors[run.label], dashed=True)
                    drawn = True
            if drawn and run not in shown:
                shown.append(run)
        _style(ax, panel.title, XLABEL[panel.kind], panel.ylabel)
        if panel.unit_range:
            ax.set_ylim(-0.02, 1.02)
        elif panel.from_zero:
            bottom, top = ax.get_ylim()
            ax.set_ylim(0, top if top > 0 else 1)
        _widen_steps(ax)
    _legend(fig, [r for r in runs if r in shown], colors, any(p.eval_key for p in panels))
    fig.savefig(path)
    return True


def step_time_rows(run: Run) -> tuple[list[int], dict[str, list[float]]]:
    """Steps and the seconds of each phase at those steps (rows with a step time only)."""
    split = [(r["step"], phase_split(r)) for r in run.rows]
    split = [(s, p) for s, p in split if p is not None]
    return [s for s, _ in split], {ph: [p[ph] for _, p in split] for ph in PHASES}


def draw_step_time(runs: list[Run], path: Path) -> bool:
    """One stacked chart per RL run: seconds per step by phase over the steps (running means when long)."""
    timed = [(r, *step_time_rows(r)) for r in runs]
    timed = [t for t in timed if t[1]]
    if not timed:
        return False
    fig, axes = _figure(len(timed))
    top = 0.0
    for ax, (run, steps, phases) in zip(axes, timed):
        half = smoothing_half_width(len(steps))
        stacks = [running_mean(phases[ph], half) for ph in PHASES]
        ax.stackplot(steps, stacks, colors=[PHASE_COLORS[ph] for ph in PHASES], labels=PHASES, alpha=0.9)
        top = max(top, max(sum(col) for col in zip(*stacks)))
        title = run.label + (f" (running mean of {2 * half + 1} logged steps)" if half else "")
        _style(ax, title, "RL step", "seconds per step")
        if len(steps) > 1:
            ax.set_xlim(steps[0], steps[-1])
        else:
            _widen_steps(ax)
    for ax in axes:
        ax.set_ylim(0, top * 1.05 or 1.0)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(PHASES), frameon=False, fontsize=10)
    fig.savefig(path)
    return True


def draw_step_share(runs: list[Run], path: Path) -> bool:
    """Horizontal stacked bars: a run's mean seconds per step by phase, each segment's share written in it."""
    rows = []
    for run in runs:
        steps, phases = step_time_rows(run)
        if steps:
            rows.append((run.label, {ph: sum(v) / len(v) for ph, v in phases.items()}))
    if not rows:
        return False
    Figure, FigureCanvasAgg, _ = _matplotlib()
    fig = Figure(figsize=(9.0, 1.6 + 0.55 * len(rows)), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    labels = [label for label, _ in rows][::-1]
    means = [m for _, m in rows][::-1]
    left = [0.0] * len(rows)
    width_total = max(sum(m.values()) for m in means) or 1.0
    for ph in PHASES:
        widths = [m[ph] for m in means]
        ax.barh(labels, widths, left=left, color=PHASE_COLORS[ph], label=ph, height=0.6)
        for y, (lft, wdt, m) in enumerate(zip(left, widths, means)):
            total = sum(m.values())
            if total > 0 and wdt / width_total > 0.07:
                ax.text(lft + wdt / 2, y, f"{100 * wdt / total:.0f}%", ha="center", va="center", fontsize=9,
                        color="white")
        left = [a + b for a, b in zip(left, widths)]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:.3g} s", va="center", fontsize=9)
    ax.set_xlim(0, width_total * 1.15)
    ax.set_xlabel("mean seconds per RL step")
    ax.set_title("Step time by phase", fontsize=11)
    ax.grid(True, axis="x", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=len(PHASES), frameon=False, fontsize=10)
    fig.savefig(path)
    return True


def run_colors(runs: list[Run]) -> dict[str, str]:
    """A colour per run label; the runs of one group (a sweep point's seeds) share theirs."""
    groups: dict[str, int] = {}
    for r in runs:
        groups.setdefault(r.group or r.label, len(groups))
    return {r.label: RUN_COLORS[groups[r.group or r.label] % len(RUN_COLORS)] for r in runs}
