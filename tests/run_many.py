"""Several `launch.py -m` multiruns in one process, one after another, as the test matrices need them:

    python -m tests.run_many '[["-m", "framework=deepspeed", ...], ["-m", ...]]'

Each entry is the argument list a user would give launch.py; each runs through launch.py's own
main (its override check, Hydra's composition, the sweep's callbacks), with Hydra's global state
cleared in between. One process instead of one per multirun saves each later multirun the start-up
(Python, Hydra, pandas: ~2.5 s; a test session runs about 65 of them). Stops at the first multirun
that exits non-zero, with its exit code.
"""
from __future__ import annotations

import json
import sys


def main(argvs: list[list[str]]) -> int:
    from hydra.core.global_hydra import GlobalHydra

    import launch

    for argv in argvs:
        GlobalHydra.instance().clear()
        sys.argv = ["launch.py", *argv]
        try:
            launch.check_override_syntax(argv)
            launch.main()
        except SystemExit as e:
            if e.code not in (0, None):
                print(f"run_many: launch.py {' '.join(argv)} exited {e.code}", file=sys.stderr)
                return e.code if isinstance(e.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
