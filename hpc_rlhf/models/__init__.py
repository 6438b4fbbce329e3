"""Models layer: byte-level tokenizer, tiny test models, loading (LoRA / QLoRA), adapter merging, the shape of a
model from its config.  Import the modules themselves: a login node's commands read paths.py and shape.py without
loading torch."""
