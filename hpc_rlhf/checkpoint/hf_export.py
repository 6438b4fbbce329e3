"""Export the trained model as a Hugging Face folder (safetensors + tokenizer), atomically.

Under ZeRO-3 the parameters are gathered first; only rank 0 writes.  A LoRA model is written as
its adapter (peft format); `hpc-rlhf lora-merge` turns that into a full model.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from ..distributed.collectives import barrier
from ..models.files import follow_umask


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def full_state_dict(engine) -> dict | None:
    """The whole model's state dict on rank 0 (None elsewhere), gathered under ZeRO-3."""
    if engine.zero_optimization_stage() == 3:
        sd = engine._zero3_consolidated_16bit_state_dict()
        return sd if _rank() == 0 else None
    return engine.module.state_dict() if _rank() == 0 else None


def save_hf(engine, tokenizer, out_dir: str | Path, extra_files: dict[str, str] | None = None) -> Path:
    """Collective: write ``out_dir`` via a temporary folder renamed into place."""
    out = Path(out_dir)
    state = full_state_dict(engine)
    if _rank() == 0:
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model = engine.module
        model.save_pretrained(tmp, state_dict={k: v.detach().cpu() for k, v in state.items()},
                              safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        follow_umask(tmp)  # safetensors writes 0600
        # Files written by the trainer beside the model (metrics, events) stay where they are.
        for p in tmp.iterdir():
            target = out / p.name
            if target.exists():
                shutil.rmtree(target) if target.is_dir() else target.unlink()
        out.mkdir(parents=True, exist_ok=True)
        for p in tmp.iterdir():
            p.rename(out / p.name)
        tmp.rmdir()
    barrier()
    return out
