"""Import a launch config as train-ledger overrides, print its prediction, and write them as a sweep file.

    python -m importers megatron [--world N] [--out FILE] RUN_SH
    python -m importers megatron --world N [--out FILE] -- PRETRAIN_GPT_ARGS...

RUN_SH: a script whose torchrun line runs pretrain_gpt.py (the world is its --nnodes x --nproc_per_node;
`mode=dry` writes one); or the arguments themselves after `--` with --world. Flags the ledger does not
model are refused by name (exit 2), flags that change no prediction listed as ignored. FILE (default
imported_megatron.yaml) runs with `python -m sweeps.plan FILE` (add `cluster=...` for your cluster).
"""
from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def predict_table(overrides: list[str]) -> str:
    """The printed table of `launch.py mode=predict <overrides>` (composed the way launch.py composes)."""
    from hydra import compose, initialize_config_dir

    from conf.schema import register
    from launchers.job import check

    register()
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["mode=predict", *overrides])
    _, _, pl = check(cfg)
    return pl.report()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else None
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m importers", description=__doc__.splitlines()[0])
    ap.add_argument("framework", choices=["megatron"])
    ap.add_argument("run_sh", nargs="?")
    ap.add_argument("--world", type=int, help="GPUs the command runs on (default: its torchrun line's)")
    ap.add_argument("--out", default="imported_megatron.yaml")
    a = ap.parse_args(own)
    sys.path.insert(0, REPO)
    import yaml

    from importers import megatron
    from ledger.errors import ConfigError

    try:
        if extra is not None:
            if not a.world:
                ap.error("--world N is needed with arguments after --")
            args, world = extra, a.world
        elif a.run_sh:
            args, world = megatron.run_sh_args(a.run_sh)
            world = a.world or world
        else:
            ap.error("give RUN_SH or the arguments after --")
        overrides, ignored = megatron.overrides(args, world)
        table = predict_table(overrides)
    except ConfigError as e:
        print(f"import refused: {e}", file=sys.stderr)
        return 2
    print(table)
    print("overrides: " + " ".join(overrides))
    if ignored:
        print("ignored (they change no prediction): " + " ".join(ignored))
    name = os.path.splitext(os.path.basename(a.out))[0]
    with open(a.out, "w") as f:
        yaml.safe_dump({"name": name, "runs": [{"framework": "megatron", "overrides": overrides}]}, f, sort_keys=False)
    print(f"sweep file: {a.out} (python -m sweeps.plan {a.out} cluster=...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
