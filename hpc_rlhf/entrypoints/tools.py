"""`hpc-rlhf tiny-model`, `hpc-rlhf import-gguf`, `hpc-rlhf lora-merge`, `hpc-rlhf serve-reward` and
`hpc-rlhf status` and `hpc-rlhf report`."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from ..launch.status import StatusError, render, run_status
from ..reports import ReportError, write_report
from ..rewards.errors import RewardError
from . import Subcommand


def add_tiny_model_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hpc-rlhf tiny-model OUT ...``."""
    from ..models import tiny
    parser.add_argument("out", help="folder to write the model and tokenizer to")
    parser.add_argument("--arch", choices=tiny.ARCHS, default="llama", help="model architecture")
    parser.add_argument("--hidden-size", type=int, default=64, help="hidden size")
    parser.add_argument("--layers", type=int, default=2, help="number of transformer layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    parser.add_argument("--intermediate-size", type=int, default=None, help="MLP size (default: 4 x hidden)")
    parser.add_argument("--max-position", type=int, default=512, help="maximum sequence length")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--dtype", choices=tuple(tiny.DTYPES), default="fp32", help="dtype of the saved weights")


def tiny_model(args: argparse.Namespace, rest: list[str] | None = None) -> int:
    """Build the model described by ``args``; print its path and parameter count."""
    from ..models import tiny
    out = tiny.build_tiny_model(args.out, arch=args.arch, hidden_size=args.hidden_size, num_layers=args.layers,
                                num_heads=args.heads, num_kv_heads=args.kv_heads,
                                intermediate_size=args.intermediate_size,
                                max_position_embeddings=args.max_position, seed=args.seed, dtype=args.dtype)
    print(f"wrote {args.arch} model to {out} ({tiny.count_parameters(out):,} parameters)")
    return 0


def add_import_gguf_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hpc-rlhf import-gguf FILE OUT [--dtype fp32|bf16] [--overwrite]``."""
    from ..models import gguf
    parser.add_argument("file", help="the GGUF file (llama.cpp's single-file checkpoint, any quantization)")
    parser.add_argument("out", help="folder to write the transformers model, tokenizer and chat template to")
    parser.add_argument("--dtype", choices=gguf.DTYPES, default="fp32",
                        help="dtype the weights are dequantized to (default fp32: bf16 is slow on most CPUs)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT when it exists")


def import_gguf(args: argparse.Namespace, rest: list[str] | None = None) -> int:
    """Convert ``args.file`` into the folder ``args.out``; print where it went."""
    from ..models import gguf
    out = gguf.import_gguf(args.file, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"imported {args.file} into {out}")
    return 0


def add_lora_merge_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hpc-rlhf lora-merge ADAPTER_DIR OUT [--base PATH] [--dtype fp32|bf16]``."""
    from ..models import lora
    parser.add_argument("adapter_dir", help="folder holding adapter_config.json and the adapter weights")
    parser.add_argument("out", help="folder to write the merged model to")
    parser.add_argument("--base", default=None,
                        help="base model folder (default: base_model_name_or_path of the adapter config)")
    parser.add_argument("--dtype", choices=tuple(lora.DTYPES), default="fp32", help="dtype of the merged weights")


def lora_merge(args: argparse.Namespace, rest: list[str] | None = None) -> int:
    """Merge ``args.adapter_dir`` into its base and print where the merged model went."""
    from ..models import lora
    out = lora.merge_lora(args.adapter_dir, args.out, base=args.base, dtype=args.dtype)
    print(f"merged {args.adapter_dir} into {out}")
    return 0


def add_serve_reward_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hpc-rlhf serve-reward``."""
    from ..rewards.server import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_PORT
    parser.add_argument("--reward-func", required=True, metavar="FILE",
                        help="Python file defining reward_func(queries, prompts, labels), or builtin:math")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; use 0.0.0.0 to serve other nodes, with a token)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 = a free one)")
    tok = parser.add_mutually_exclusive_group()
    tok.add_argument("--token-env", metavar="NAME", help="require this environment variable's value as bearer token")
    tok.add_argument("--token-file", metavar="PATH", help="require this file's content as bearer token")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="refuse larger request bodies with 413")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per reward_func call")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds one reward_func call may take before its samples count as failed (0 = none)")


def serve_reward(args: argparse.Namespace, rest: list[str] | None = None,
                 stop_event: threading.Event | None = None) -> int:
    """Serve until SIGINT/SIGTERM (or until ``stop_event`` is set); print the URL on stdout first."""
    from ..rewards.server import read_token, start_server
    try:
        token = read_token(args.token_env, args.token_file)
    except ValueError as e:
        print(f"hpc-rlhf serve-reward: {e}", file=sys.stderr)
        return 2
    try:
        handle = start_server(args.reward_func, host=args.host, port=args.port, token=token,
                              max_request_bytes=args.max_request_bytes, batch_size=args.batch_size,
                              timeout_s=args.timeout or None)
    except RewardError as e:
        print(f"hpc-rlhf serve-reward: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"hpc-rlhf serve-reward: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    stop = stop_event or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    print(f"serving {args.reward_func} at {handle.url} (POST /score, GET /health"
          f"{', bearer token required' if token else ''})", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        handle.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def add_status_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hpc-rlhf status RUN_DIR [--json] [--ckpt-path DIR]``."""
    parser.add_argument("run_dir", help="the run's ckpt.save_path (where metrics.jsonl and attempts.jsonl are)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text block")
    parser.add_argument("--ckpt-path", default=None,
                        help="the run's ckpt.ckpt_path (default: the one its attempt record names)")


def status(args: argparse.Namespace, rest: list[str] | None = None) -> int:
    """Print where the run in ``args.run_dir`` stands (docs/status_command.md); exit 2 when it is no run."""
    try:
        st = run_status(args.run_dir, ckpt_path=args.ckpt_path)
    except StatusError as e:
        print(f"hpc-rlhf status: {e}", file=sys.stderr)
        return 2
    print(json.dumps(st, indent=1) if args.json else render(st), end="\n" if args.json else "")
    return 0


def add_report_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hpc-rlhf report RUN_DIR [RUN_DIR ...] --out DIR``."""
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a run's ckpt.save_path (where its metrics.jsonl is); several runs are overlaid")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="folder to write the charts (PNG), report.html and summary.md to")


def report(args: argparse.Namespace, rest: list[str] | None = None) -> int:
    """Write the report of ``args.run_dirs`` into ``args.out``; print what was written."""
    try:
        written = write_report(args.run_dirs, args.out)
    except ReportError as e:
        print(f"hpc-rlhf report: {e}", file=sys.stderr)
        return 2
    n = len(written.images)
    print(f"wrote {n} chart{'s' * (n != 1)}, report.html and summary.md to {written.out}")
    return 0


SUBCOMMANDS = [
    Subcommand("tiny-model", "build a random-weight tiny model and a local tokenizer", add_tiny_model_args, tiny_model),
    Subcommand("import-gguf", "convert a GGUF checkpoint into a transformers folder (weights dequantized)",
               add_import_gguf_args, import_gguf),
    Subcommand("lora-merge", "merge a LoRA adapter into its base model", add_lora_merge_args, lora_merge),
    Subcommand("serve-reward", "serve a reward-function file over HTTP (127.0.0.1 by default)", add_serve_reward_args,
               serve_reward),
    Subcommand("status", "where a run stands, from its files: steps, checkpoint, SLURM attempts, ETA, errors, "
                         "running?", add_status_args, status, light=True),
    Subcommand("report", "charts, report.html and summary.md of one or more runs, read from their folders "
                         "(docs/report.md)", add_report_args, report, light=True),
]
