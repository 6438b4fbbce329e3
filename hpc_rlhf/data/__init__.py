"""Data layer: sources -> rows -> tokenized samples -> mixed, sampled, batched model inputs."""
from .batching import EpochSampler, split_micro_batches
from .mixing import mix
from .packing import Batch, collate_packed, collate_padded, packed_attention_mask
from .rows import BadRows, DataError
from .sft import Sample, build_sft_samples, load_sft_data
from .sources import load_source

__all__ = ["BadRows", "Batch", "DataError", "EpochSampler", "Sample", "build_sft_samples", "collate_packed",
           "collate_padded", "load_sft_data", "load_source", "mix", "packed_attention_mask", "split_micro_batches"]
