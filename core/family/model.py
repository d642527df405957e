"""The interface a family's model implements once its family is chosen (torch side); see
docs/reference.md and the worked family in docs/plugins.md."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Sequence

import torch

from .forward_pass import ForwardPass
from .media import MediaPiece
from .spec import StateLayout

if TYPE_CHECKING:
    from tensorfold.adapters.paged_kv import PagedRows
    from tensorfold.adapters.stream_state import StreamSlots


class FamilyModel(ABC):
    """A loaded model. `layout` says what each stream keeps; `forward` runs one pass.

    forward(fp, rows, slots): read and write K/V rows through `fp`'s page tables in `rows`,
    read fixed state from `slots` (zeros for a stream whose run starts at 0) and leave the
    state after the run's last row there. Returns fp32 logits [len(fp.logit_rows), vocab].

    verify_graphs: the forward runs a uniform verify pass (ForwardPass.rows_each) from the
    device meta alone on the Triton path, its taps recorded with `fp.tap_rows`, so the lanes
    may replay it as a CUDA graph; False: verify passes run eagerly.
    """

    verify_graphs = False

    name: str
    layout: StateLayout
    vocab_size: int
    max_positions: int
    device: torch.device
    dtype: torch.dtype

    @abstractmethod
    def forward(self, fp: ForwardPass, rows: "PagedRows", slots: "StreamSlots") -> torch.Tensor: ...

    def encode_media(self, pieces: Sequence[MediaPiece]) -> list[torch.Tensor]:
        """Each piece's row embeddings [piece.rows, hidden] in the model's dtype on its device,
        from the piece's `inputs` (its `MediaProcessor.prepare_image`'s): what the prompt pass
        writes over the placeholder rows (`ForwardPass.place_embeds`). A piece's rows must not
        depend on the other pieces. A family without a tower leaves this as it is."""
        raise NotImplementedError(f"the {self.name} family takes no media")
