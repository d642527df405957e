"""Media pieces in a prompt: placeholders expanded, store keys, and a pass's media rows."""

from __future__ import annotations

import pytest
import torch

from tensorfold.family.forward_pass import ForwardPass, StreamRows
from tensorfold.family.media import (
    MediaRefused,
    expand_media,
    media_key,
    store_key,
    tower_batches,
)


class Boxed:
    kinds = frozenset({"image"})
    placeholder = "<img>"
    placeholder_id = 9
    block = True

    def prepare_image(self, image):  # pragma: no cover - not called here
        raise AssertionError

    def image_ids(self, rows: int) -> tuple[list[int], int]:
        return [7, *[9] * rows, 8], 1


def test_each_placeholder_becomes_its_images_ids_and_piece() -> None:
    ids, pieces = expand_media([1, 9, 2, 9], Boxed(), [("a", 2, 11), ("b", 3, 12)])
    assert ids == [1, 7, 9, 9, 8, 2, 7, 9, 9, 9, 8]
    assert [(p.start, p.rows, p.key, p.inputs, p.block) for p in pieces] == [
        (2, 2, 11, "a", True),
        (7, 3, 12, "b", True),
    ]
    assert store_key(ids, pieces) == [1, 7, -11, -11, 8, 2, 7, -12, -12, -12, 8]


def test_a_count_of_placeholders_unlike_the_images_is_refused() -> None:
    with pytest.raises(MediaRefused, match="placed 1 image"):
        expand_media([1, 9], Boxed(), [("a", 2, 11), ("b", 2, 12)])


class Heard(Boxed):
    kinds = frozenset({"image", "audio"})
    audio_placeholder = "<aud>"
    audio_placeholder_id = 6

    def prepare_audio(self, samples, rate):  # pragma: no cover - not called here
        raise AssertionError

    def audio_ids(self, rows: int) -> tuple[list[int], int]:
        return [4, *[6] * rows, 5], 1


def test_images_and_clips_fill_their_own_placeholders_in_order() -> None:
    ids, pieces = expand_media(
        [1, 6, 9, 6], Heard(), [("img", 1, 11)], [("clip0", 2, 21), ("clip1", 1, 22)]
    )
    assert ids == [1, 4, 6, 6, 5, 7, 9, 8, 4, 6, 5]
    assert [(p.start, p.rows, p.inputs, p.block, p.kind) for p in pieces] == [
        (2, 2, "clip0", False, "audio"),
        (6, 1, "img", True, "image"),
        (9, 1, "clip1", False, "audio"),
    ]
    assert store_key(ids, pieces) == [1, 4, -21, -21, 5, 7, -11, 8, 4, -22, 5]


def test_clips_unlike_their_placeholders_or_without_audio_are_refused() -> None:
    with pytest.raises(MediaRefused, match="placed 1 audio clip"):
        expand_media([1, 6], Heard(), [], [("a", 2, 21), ("b", 2, 22)])
    with pytest.raises(MediaRefused, match="takes no audio"):
        expand_media([1, 6], Boxed(), [], [("a", 2, 21)])
    ids, _ = expand_media([1, 6], Boxed(), [])  # a family without audio: 6 is a plain token
    assert ids == [1, 6]


def test_media_keys_differ_with_any_part_and_stay_positive() -> None:
    a = media_key(b"\x00\x01", 2, "RGB")
    assert a == media_key(b"\x00\x01", 2, "RGB")
    assert a != media_key(b"\x00\x02", 2, "RGB") and a != media_key(b"\x00\x01", 3, "RGB")
    assert 1 <= a < 2**62


def test_a_pass_places_media_rows_and_lets_a_block_see_itself_whole() -> None:
    image = torch.arange(12.0).view(3, 4)
    text = StreamRows(1, 3, [5], [2])
    media = StreamRows(0, 0, [1, 2, 9, 9, 9, 3], [0, 1], embeds=[(2, image)], blocks=[(2, 5)])
    fp = ForwardPass([text, media], page_rows=4)
    assert fp.embed_rows is not None and fp.embed_rows.tolist() == [3, 4, 5]
    x = fp.place_embeds(torch.zeros(7, 4))
    assert torch.equal(x[3:6], image) and not x[:3].any() and not x[6].any()
    assert fp.attend_upto is not None and fp.attend_upto.tolist() == [3, 0, 1, 4, 4, 4, 5]
    plain = ForwardPass([text], page_rows=4)
    assert plain.embed_rows is None and plain.attend_upto is None


def test_media_rows_outside_their_run_are_refused() -> None:
    with pytest.raises(ValueError, match="not inside"):
        ForwardPass([StreamRows(0, 0, [1, 2], [0], embeds=[(1, torch.zeros(2, 4))])], 4)


@pytest.mark.parametrize(
    ("sizes", "bound", "want"),
    [
        ([], 10, []),
        ([4, 3, 3], 10, [[0, 1, 2]]),
        ([4, 3, 4, 9, 1], 10, [[0, 1], [2], [3, 4]]),
        ([12, 2, 11], 10, [[0], [1], [2]]),  # a piece past the bound runs alone
        ([5, 5, 5], 5, [[0], [1], [2]]),
    ],
)
def test_a_tower_runs_consecutive_pieces_within_the_plans_size(
    sizes: list[int], bound: int, want: list[list[int]]
) -> None:
    batches = tower_batches(sizes, bound)
    assert [list(b) for b in batches] == want
    assert [i for b in batches for i in b] == list(range(len(sizes)))
