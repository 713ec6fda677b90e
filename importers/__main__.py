"""Import a launch config as train-ledger overrides, print its prediction, and write them as a sweep file.

    python -m importers megatron [--world N] [--out FILE] RUN_SH
    python -m importers megatron --world N [--out FILE] -- PRETRAIN_GPT_ARGS...
    python -m importers deepspeed --world N [--out FILE] DS_CONFIG_JSON -- MODEL_OVERRIDES...
    python -m importers titan [--function NAME] [--world N] [--out FILE] CONFIG_MODULE_PY

RUN_SH: a script whose torchrun line runs pretrain_gpt.py (the world is its --nnodes x --nproc_per_node;
`mode=dry` writes one); or the arguments themselves after `--` with --world. A torchtitan config is a
module whose function (default ledger_config, as `mode=dry` writes it) returns the Trainer.Config; the
module is executed. A ds_config holds no model:
name it after `--` (model=llama3_8b, or model.hf_config=PATH, and any model.* field). Settings the ledger
does not model are refused by name (exit 2), those that change no prediction listed as ignored. FILE
(default imported_<framework>.yaml) runs with `python -m sweeps.plan FILE` (add `cluster=...`).
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
    ap.add_argument("framework", choices=["megatron", "deepspeed", "titan"])
    ap.add_argument("path", nargs="?", help="megatron: a run.sh; deepspeed: a ds_config.json; titan: a config module")
    ap.add_argument("--function", default="ledger_config", help="titan: the module's function returning the config")
    ap.add_argument("--world", type=int, help="GPUs the command runs on (megatron: default its torchrun line's)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(own)
    a.out = a.out or f"imported_{a.framework}.yaml"
    sys.path.insert(0, REPO)
    import yaml

    from hydra.errors import HydraException

    from importers import deepspeed, megatron, titan
    from ledger.errors import ConfigError

    try:
        if a.framework == "titan":
            if not a.path:
                ap.error("titan needs CONFIG_MODULE_PY")
            overrides, ignored = titan.overrides(titan.load(a.path, a.function), a.world)
        elif a.framework == "deepspeed":
            if not (a.path and a.world):
                ap.error("deepspeed needs DS_CONFIG_JSON and --world N")
            overrides, ignored = deepspeed.overrides(deepspeed.load(a.path), a.world)
            overrides += extra or []
        else:  # megatron: the arguments after --, or a run.sh's torchrun line
            if extra is not None:
                if not a.world:
                    ap.error("--world N is needed with arguments after --")
                args, world = extra, a.world
            elif a.path:
                args, world = megatron.run_sh_args(a.path)
                world = a.world or world
            else:
                ap.error("give RUN_SH or the arguments after --")
            overrides, ignored = megatron.overrides(args, world)
        table = predict_table(overrides)
    except ConfigError as e:
        print(f"import refused: {e}", file=sys.stderr)
        return 2
    except HydraException as e:  # a model override Hydra cannot compose
        print(f"import refused: {e}", file=sys.stderr)
        return 2
    print(table)
    print("overrides: " + " ".join(overrides))
    if ignored:
        print("ignored (they change no prediction): " + " ".join(ignored))
    name = os.path.splitext(os.path.basename(a.out))[0]
    with open(a.out, "w") as f:
        yaml.safe_dump({"name": name, "runs": [{"framework": a.framework, "overrides": overrides}]}, f, sort_keys=False)
    print(f"sweep file: {a.out} (python -m sweeps.plan {a.out} cluster=...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
