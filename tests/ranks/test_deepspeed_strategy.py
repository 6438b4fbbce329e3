"""The DeepSpeed engine's set-up: over one rank, ZeRO-0 leaves out DeepSpeed's gradient all-reduce (a copy of every
gradient into one flat buffer and back) and updates the weights exactly as the engine with it does; over two ranks
the all-reduce stays and averages the ranks' gradients."""
from __future__ import annotations

from safetensors.torch import load_file

from _dist import run_ranks


def _train(model_dir: str) -> dict:
    """Two optimizer steps of ZeRO-0 fp32 on rank-dependent data, once as ``build_engine`` sets the engine up and
    once with DeepSpeed's all-reduce forced on; whether ``build_engine`` kept the all-reduce, the weights after
    each, and how many elements each all-reduced beyond single numbers (clipping all-reduces its norm)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.config.sections import OptimizerConfig
    from hpc_rlhf.engines.deepspeed_strategy import build_engine, optimizer_step

    real_all_reduce, calls = dist.all_reduce, []

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    out: dict = {}
    for forced in (False, True):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        engine = build_engine(model, OptimizerConfig(zero_stage=0, max_norm=1.0), 1e-2, "fp32", 2,
                              dist.get_world_size())
        if not forced:
            out["kept"] = engine.enable_backward_allreduce
        engine.enable_backward_allreduce |= forced
        ids = torch.arange(24).reshape(2, 12) % 50 + 3 + 7 * dist.get_rank()  # each rank its own tokens
        calls.clear()
        dist.all_reduce = counted
        try:
            for _ in range(2):
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                optimizer_step(engine)
        finally:
            dist.all_reduce = real_all_reduce
        out["forced" if forced else "built"] = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        out["forced_reduced" if forced else "built_reduced"] = sum(n for n in calls if n > 1)
    return out


def test_one_rank_leaves_out_the_all_reduce_with_the_same_update(tiny_dir):
    [r] = run_ranks(_train, 1, str(tiny_dir))
    before = load_file(str(tiny_dir / "model.safetensors"))
    weights = sum(w.numel() for w in before.values())
    assert r["kept"] is False and r["built_reduced"] == 0 and r["forced_reduced"] == 2 * weights  # every gradient
    for name, w in r["built"].items():
        assert w.equal(r["forced"][name]), name  # bit for bit: the mean over one rank is the gradient itself
    assert any(not r["built"][k].equal(v) for k, v in before.items() if k in r["built"])  # the steps did train


def test_two_ranks_keep_the_all_reduce(tiny_dir):
    r0, r1 = run_ranks(_train, 2, str(tiny_dir))
    assert r0["kept"] is True and r0["built_reduced"] == r0["forced_reduced"] > 0
    for name, w in r0["built"].items():  # different data on each rank, the same weights: the gradients were averaged
        assert w.equal(r1["built"][name]), name
