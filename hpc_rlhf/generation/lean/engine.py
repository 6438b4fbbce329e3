"""The lean engine: the transformers engine with its decode hooks run by ``LeanDecoder`` (llama-family models: the
same math as the transformers forward with far fewer Python calls per token).  On CUDA each decode step is replayed
as a CUDA graph (``cuda_graphs``), and finished rows then stay in the batch to its end, as the graph's shapes are
fixed.  On the CPU in fp32 a prompt's samples share its prefilled cache (``shared_prefix``;
``LeanDecoder.select_rows``), and products of a few rows go to a compiled kernel (``few_row_kernel``;
``few_rows``)."""
from __future__ import annotations

import torch

from ..hf import HFEngine
from ..specs import LEAN
from .decoder import LeanDecoder, lean_supported


class LeanEngine(HFEngine):
    spec = LEAN

    def __init__(self, model_path_or_module, dtype="fp32", device="cpu", max_batch_size: int = 64,
                 cuda_graphs: bool = True, shared_prefix: bool = True, few_row_kernel: bool = True):
        super().__init__(model_path_or_module, dtype, device, max_batch_size)
        if not lean_supported(self.model):
            raise ValueError(f"the lean engine does not run {type(self.model).__name__} "
                             f"({getattr(self.model.config, 'model_type', '?')}): use the transformers engine")
        self._lean = LeanDecoder(self.model, cuda_graphs, shared_prefix, few_row_kernel=few_row_kernel)

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, max_len: int):
        self._lean.start(ids.shape[0], max_len, self.dtype, self.device)
        return self._lean.forward(ids, pos, mask.bool()).float(), None

    def _select_rows(self, cache, rows: torch.Tensor) -> None:
        self._lean.select_rows(rows)

    def _decode(self, cache, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self._lean.decode(tokens, pos).float()

    def _compacts(self) -> bool:
        return not self._lean.graphed(self.device)

    def _release(self, cache) -> None:
        self._lean.release()

    def finish_weight_update(self) -> None:
        self._lean.weights_changed()  # shared weights change in place, unseen by the tensors' versions
        super().finish_weight_update()
