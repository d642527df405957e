"""tensorfold family plugin: GLM-5.3-Flash's text model (`glm5_next`).

Importing the package is cheap; `tensorfold_glm.model:load` pulls in torch once the family is
chosen.
"""

from .plugin import GLM5_NEXT

__all__ = ["GLM5_NEXT"]
