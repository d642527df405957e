"""tensorfold family plugin: LFM2 / LFM2.5 MoE (`lfm2_moe`).

Importing the package is cheap; `tensorfold_lfm2_moe.model:load` pulls in torch once the family
is chosen.
"""

from .plugin import LFM2_MOE

__all__ = ["LFM2_MOE"]
