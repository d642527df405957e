"""Run a bench script in this process with module attributes set first: one side of an A/B,
each side in a process of its own, the same tree.

    python3 bench/experiments/with_switch.py tensorfold.ops.switches.OWN_RECURRENT=False \
        bench/glm_speed.py --sections decode

Each MODULE.ATTR=VALUE before the script sets one attribute: VALUE a Python literal, or else an
expression evaluated in the module's namespace (tensorfold.ops.switches.NAME=False sets a
registered switch), e.g.
    tensorfold.ops.triton_linear.TUNED="{**TUNED, (6144, 2048): Tiles(32, 128, 4, 4, wave=1)}"
"""

from __future__ import annotations

import ast
import importlib
import runpy
import sys


def main(argv: list[str]) -> None:
    while argv and "=" in argv[0] and not argv[0].endswith(".py"):
        target, value = argv.pop(0).split("=", 1)
        module, attr = target.rsplit(".", 1)
        mod = importlib.import_module(module)
        if module == "tensorfold.ops.switches":  # a registered switch: set through the registry
            mod.set_value(attr, ast.literal_eval(value))
            print(f"{target} = {value}", flush=True)
            continue
        if not hasattr(mod, attr):
            raise SystemExit(f"{module} has no attribute {attr!r}")
        try:
            setattr(mod, attr, ast.literal_eval(value))
        except (ValueError, SyntaxError):
            setattr(mod, attr, eval(value, vars(mod)))  # noqa: S307 (a bench's own command line)
        print(f"{target} = {value}", flush=True)
    if not argv:
        raise SystemExit(__doc__)
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
