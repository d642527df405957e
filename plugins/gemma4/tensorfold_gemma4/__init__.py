"""tensorfold family plugin: Gemma 4's text model (`gemma4`).

Importing the package is cheap; `tensorfold_gemma4.model:load` pulls in torch once the family is
chosen.
"""

from .plugin import GEMMA4

__all__ = ["GEMMA4"]
