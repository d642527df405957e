"""`python -m tensorfold.engine.tp_follower ARGS`: a tensor-parallel follower rank that rank 0
started (--tp N). It joins rank 0's store, opens its shard as start opens a rank, and repeats
rank 0's operations (tensor_parallel.follow) until rank 0 stops it."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ..config.logs import configure_logging
from ..config.settings import Settings
from ..family.plugins import choose_family, get_plugin_manager
from .start import USER_REFUSALS, open_rank
from .tensor_parallel import JOINED_KEY, Launch, follow


def main(argv: list[str] | None = None) -> int:
    args = json.loads((argv or sys.argv[1:])[0])
    settings = Settings(**args["settings"])
    configure_logging(settings.log_format, settings.log_level)
    launch = Launch(args["rank"], args["world"], args["rank"], "127.0.0.1", args["port"], True)
    store = dist.TCPStore(
        "127.0.0.1",
        args["port"],
        launch.world,
        is_master=False,
        timeout=timedelta(seconds=settings.tp_timeout_s),
    )
    store.set(JOINED_KEY.format(launch.rank), "1")
    spec = choose_family(args["family"], get_plugin_manager(settings))
    folder = Path(args["model"])
    return follow(
        settings, spec, folder, launch, store, open_rank=open_rank, refusals=USER_REFUSALS
    )


if __name__ == "__main__":
    sys.exit(main())
