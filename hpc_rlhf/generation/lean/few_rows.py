"""Compiled kernels for the lean decoder on x86 CPUs (``few_rows.cpp``): its products and its decode steps.

At 8 rows PyTorch's CPU operations spend most of their time outside the arithmetic: on this project's 2-core AMD
EPYC (Zen 3) with 2 threads, a 256 x 768 product of 8 rows took 68-83 µs in oneDNN and 46 µs in this kernel, an
RMS norm of 8 x 256 values 36 µs, a decode step's attention over 38 slots 44-89 µs.  ``linear_rows`` multiplies
a few rows (at most ``MAX_ROWS``) by linear weights in their own layout, with the RMS norm before a product or the
MLP's ``silu(gate) * up`` done on the way in.  ``linear_panels`` multiplies more rows by weights packed in panels
of 24 outputs (``pack_panels``), the same on the way in and a residual added in its sums: on SmolLM2-135M's decode
shapes a decode step's products at 64 rows took 104.9 ms, 0.89 of the fp32 peak, against oneDNN's 125.6 ms (0.74;
Zen 3, 2 threads, ``benchmarks/decode_products.py``).
``rope_store`` is a decode step's rotary embedding and cache write in one pass, and ``attend_one`` its attention,
over a shared prompt prefix too, where at SmolLM2's 64 rows of 8 prompts it took 0.47-1.81 ms a layer against
1.09-2.51 for PyTorch's operations (``split_attention``; 64 to 250 own slots a row), reading the rows' own keys and
values at about the copy rate (``benchmarks/decode_attention.py``).

``linear_rows`` reads each weight in its ``nn.Linear`` layout (no copy); the decoder makes the panels again after
its weights change.  The kernels are compiled with the machine's C++ compiler through ``torch.utils.cpp_extension``
on first use (about 40 s) and cached by PyTorch (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``);
``python -m hpc_rlhf.generation.lean.few_rows`` builds them ahead (``scripts/setup_env.sh`` does).  Where they cannot be
built (not an x86 CPU with AVX2, no compiler or headers) ``kernel()`` logs why once and returns None, and the
decoder keeps PyTorch's operations.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("few_rows.cpp")
# PyTorch's cache keeps a build in a folder named after it, and ninja rebuilds it whenever the compiler's command
# changes, which names the environment's include folders: two environments sharing the cache under one name
# (.venv and .venv-vllm, or two checkouts) would rebuild it in turn, ~40 s each time, and load each other's build
# of another PyTorch.  The name carries the PyTorch version and where that PyTorch is installed.
NAME = ("hpc_rlhf_few_rows_torch" + "".join(c if c.isalnum() else "_" for c in torch.__version__) + "_"
        + hashlib.sha256(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:10])
MAX_ROWS = 8  # the most rows a product sends to linear_rows (above: linear_panels)
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]  # -fopenmp: at::parallel_for splits the outputs among threads


def cpu_supported() -> str | None:
    """None where this CPU runs the kernel (x86-64 with AVX2), else why not."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"the CPU is {machine}, not x86-64"
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith(("AVX2", "AVX512")):
        return f"the CPU has no AVX2 (PyTorch reports {capability})"
    return None


def build(source: Path = SOURCE, name: str = NAME):
    """Compile (or load from PyTorch's cache) the kernel in ``source``; None, with a warning that says why, if
    it cannot be built here."""
    reason = cpu_supported()
    if reason is None:
        try:
            return load(name, [str(source)], extra_cflags=FLAGS, verbose=False)
        except Exception as exc:  # noqa: BLE001 - any build failure leaves PyTorch's operations in use
            reason = f"building {source} failed: {type(exc).__name__}: {str(exc).strip()[-2000:]}"
    log.warning("few-row kernel unavailable (%s); the lean decoder keeps PyTorch's operations", reason)
    return None


@functools.cache
def kernel():
    """The built module (``linear_rows``, ``pack_panels``, ``linear_panels``, ``rope_store``, ``attend_one``), or
    None where it cannot be built; built once per process."""
    return build()


def linear_rows(module, x: torch.Tensor, weights: list[torch.Tensor], norm: torch.nn.Module | None = None,
                gated: bool = False) -> torch.Tensor:
    """``x`` [..., K] times each of ``weights`` ([N_i, K], float32, contiguous) transposed, the outputs side by
    side: [..., sum N_i].  With ``norm`` (a Llama RMS norm module: ``weight``, ``variance_epsilon``), ``x`` is
    normalised by it first; with ``gated``, ``x`` is [..., 2K], gate and up side by side, and the product's input
    is ``silu(gate) * up``.  Both inside the kernel."""
    flat = x.reshape(-1, x.shape[-1])
    if norm is None:
        y = module.linear_rows(flat, weights, gated=gated)
    else:
        y = module.linear_rows(flat, weights, norm.weight, norm.variance_epsilon, gated)
    return y.view(*x.shape[:-1], -1)


def linear_panels(module, x: torch.Tensor, panels: torch.Tensor, n: int, norm: torch.nn.Module | None = None,
                  gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] times the ``n`` outputs of ``panels`` (``module.pack_panels`` of weights [N_i, K]), with the
    norm or the gating of ``linear_rows`` on the way in, plus ``residual`` [..., n] where one is given: [..., n]."""
    flat = x.reshape(-1, x.shape[-1])
    res = None if residual is None else residual.reshape(-1, n)
    if norm is None:
        y = module.linear_panels(flat, panels, n, gated=gated, residual=res)
    else:
        y = module.linear_panels(flat, panels, n, norm.weight, norm.variance_epsilon, gated, res)
    return y.view(*x.shape[:-1], n)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    mod = kernel()
    if mod is None:
        raise SystemExit(1)
    print(f"few-row kernel built: {mod.__file__}")
