"""The validation split of the real run: settings are chosen on it, never on the held-out problems.

Carves ``--rows`` problems (default 200) out of ASDiv's training split (``scripts/real_assets.sh`` writes
2,005 training rows and 300 held-out ones) by shuffling the row positions with ``random.Random(--seed)``;
the other rows are the training rows of SFT and RL.  Every training row lands in exactly one of the two
files, each in the input order (``hpc_rlhf.data.asdiv.split_rows``).

Usage: python validation_split.py TRAIN_JSONL OUT_TRAIN_JSONL OUT_VALIDATION_JSONL [--rows 200] [--seed 1]
"""
import argparse
import json
from pathlib import Path

from hpc_rlhf.data.asdiv import split_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("train")
    ap.add_argument("out_train")
    ap.add_argument("out_validation")
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rows = [json.loads(line) for line in Path(args.train).read_text(encoding="utf-8").splitlines() if line.strip()]
    rest, validation = split_rows(rows, args.rows, args.seed)
    for rows, path in ((rest, args.out_train), (validation, args.out_validation)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"validation_split: {len(rest)} training rows -> {args.out_train}, {len(validation)} validation rows -> "
          f"{args.out_validation}")


if __name__ == "__main__":
    main()
