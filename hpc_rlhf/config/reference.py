"""The option reference in docs/options.md, generated from the config classes of the command table
(`hpc_rlhf.commands.option_reference`; a test keeps it fresh)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from .base import _type_name, allowed_values, leaf_paths

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "options.md"


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "`null`" if f.default is None else f"`{f.default!r}`".replace("|", "\\|")
    if f.default_factory is not dataclasses.MISSING:
        return f"`{f.default_factory()!r}`"
    return "required"


def option_table(cls: type) -> str:
    rows = ["| option | type | default | meaning |", "|---|---|---|---|"]
    for path, (_, f, tp) in leaf_paths(cls).items():
        allowed, bounds = allowed_values(f), f.metadata.get("range")
        if allowed:
            typ = " | ".join(map(repr, allowed)) + (" | null" if f.default is None else "")
        else:
            typ = _type_name(tp)
            if bounds:
                typ += (", each " if typ.startswith("list") else ", ") + str(bounds)
        typ = typ.replace("|", "\\|")
        aliases = f.metadata.get("aliases", ())
        helptext = (f.metadata.get("help", "") + "".join(f" (alias `{a}`)" for a in aliases)).replace("|", "\\|")
        rows.append(f"| `{path}` | {typ} | {_default(f)} | {helptext} |")
    return "\n".join(rows)


def render(commands: dict[str, type]) -> str:
    """The reference document: one option table per command (name -> its config class)."""
    parts = ["# Option reference", "",
             "Generated from the config classes by `hpc-rlhf options --write`; do not edit by hand.", "",
             "Set options in a YAML file (nested by section, e.g. `train: {learning_rate: 1e-5}`) and/or on "
             "the command line as `key=value` or `--key value`.  A key is the dotted path, or a section's "
             "path followed by a name unique inside that section, or a name unique in the whole config: "
             "`train.learning_rate=1e-5`, `learning_rate=1e-5` and `--learning_rate 1e-5` are the same, and "
             "so are `algo.clip.eps_clip`, `algo.eps_clip` and `eps_clip`.  An option's aliases (in its "
             "meaning) are read as its name is: `rollout.vllm_max_model_len` and `vllm_max_model_len` set "
             "`rollout.vllm.max_model_len`.  Lists take commas: `dataset=a.jsonl,b.jsonl`.  "
             "Unknown keys and invalid values are errors, numbers outside the range written after their type too.", ""]
    for command, cls in commands.items():
        parts += [f"## `hpc-rlhf {command}`", "", option_table(cls), ""]
    return "\n".join(parts)


def write(text: str, path: Path = DOC_PATH) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
