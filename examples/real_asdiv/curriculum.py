"""The RL curriculum of the real run: the training problems the SFT model solves sometimes.

Reads the SFT model's samples on the RL training problems (``hpc-rlhf eval`` with ``eval.save_samples``: one row
per sample with ``prompt_id``, the problem's position in the prompt file, and ``correct``), and keeps the problems
whose pass rate lies strictly between 0 and 1: a group of samples that are all right or all wrong has no
advantage to learn from.  Writes the kept rows, in the input order, and prints a JSON summary (problems, kept,
problems by number of correct samples).  Exit code 2 when a sample names a problem the prompt file lacks or whose
text differs, or when no problem is kept.

Usage: python curriculum.py PROMPTS_JSONL SAMPLES_JSONL OUT_JSONL [--summary PATH]
"""
import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from hpc_rlhf.algorithms.eval_metrics import pass_rates


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
    for s in samples:
        i = s["prompt_id"]
        if not (isinstance(i, int) and 0 <= i < len(rows)) or rows[i]["prompt"] not in s["prompt"]:
            print(f"curriculum.py: {args.samples}: the sample of prompt_id {i!r} does not match row {i} of "
                  f"{args.prompts}: evaluate the same prompt file", file=sys.stderr)
            sys.exit(2)
    rates = pass_rates(samples)
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
