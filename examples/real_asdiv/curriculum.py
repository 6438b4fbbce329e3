"""The RL curriculum of the real run: the training problems the SFT model solves sometimes.

Reads the SFT model's samples on the RL training problems (``hpc-rlhf eval`` with ``eval.save_samples``: one row
per sample with ``prompt_id``, the problem's position among the prompts evaluated, the rendered ``prompt`` and
``correct``), and keeps the problems whose pass rate lies strictly between 0 and 1: a group of samples that are
all right or all wrong has no advantage to learn from.  The eval may take a subset of the file
(``data.max_eval_prompts``: a sorted random subset), so each evaluated prompt is matched to the next row of the
prompt file whose text it contains.  Writes the kept rows, in the input order, and prints a JSON summary
(problems, rated, kept, problems by number of correct samples).  Exit code 2 when a sample matches no row, or when
no problem is kept.

Usage: python curriculum.py PROMPTS_JSONL SAMPLES_JSONL OUT_JSONL [--summary PATH]
"""
import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from hpc_rlhf.algorithms.eval_metrics import pass_rates


def rows_of(prompts: dict[int, str], rows: list[dict]) -> dict[int, int]:
    """prompt_id -> the position of its row: the ids in ascending order, each matched to the next row (after the
    previous match) whose ``prompt`` its rendered prompt contains; ValueError naming the first id with no row."""
    out, r = {}, 0
    for pid in sorted(prompts):
        while r < len(rows) and rows[r]["prompt"] not in prompts[pid]:
            r += 1
        if r == len(rows):
            raise ValueError(f"the sample of prompt_id {pid} matches no row after row {max(out.values(), default=-1)}")
        out[pid], r = r, r + 1
    return out


def solved_sometimes(rates: dict[int, float]) -> list[int]:
    """The problem positions whose pass rate r has 0 < r < 1, ascending; a problem without a rate is left out."""
    return sorted(i for i, r in rates.items() if 0 < r < 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompts")
    ap.add_argument("samples")
    ap.add_argument("out")
    ap.add_argument("--summary", help="also write the JSON summary to this file")
    args = ap.parse_args()
    rows = [json.loads(x) for x in Path(args.prompts).read_text(encoding="utf-8").splitlines() if x.strip()]
    samples = [json.loads(x) for x in Path(args.samples).read_text(encoding="utf-8").splitlines() if x.strip()]
    try:
        row = rows_of({s["prompt_id"]: s["prompt"] for s in samples}, rows)
    except ValueError as e:
        print(f"curriculum.py: {args.samples}: {e} of {args.prompts}: evaluate that prompt file", file=sys.stderr)
        sys.exit(2)
    rates = {row[p]: rate for p, rate in pass_rates(samples).items()}
    keep = solved_sometimes(rates)
    if not keep:
        print(f"curriculum.py: no problem of {args.samples} is solved sometimes (pass rate strictly between 0 and "
              f"1): nothing to train on", file=sys.stderr)
        sys.exit(2)
    Path(args.out).write_text("".join(json.dumps(rows[i], ensure_ascii=False) + "\n" for i in keep))
    n = max(Counter(s["prompt_id"] for s in samples).values())
    summary = {"problems": len(rows), "rated": len(rates), "kept": len(keep),
               "by_correct": {str(k): sum(1 for r in rates.values() if round(r * n) == k) for k in range(n + 1)},
               "mean_pass_rate": sum(rates.values()) / len(rates)}
    if args.summary:
        Path(args.summary).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
