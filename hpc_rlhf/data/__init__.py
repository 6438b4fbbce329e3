"""Data layer: sources -> rows -> tokenized samples -> mixed, sampled, batched model inputs.  Import the modules
themselves: locate.py and rows.py load neither datasets nor torch (the checks before a run use them)."""
