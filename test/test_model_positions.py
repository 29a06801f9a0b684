"""3-D RoPE positions and rope_delta against transformers' ``get_rope_index``; decode and multi-turn positions."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from orin_vlm_node.model import decode_positions, mrope_positions, rope_delta
from support.checkpoints import IMAGE_PAD, VISION_END, VISION_START, mm_token_type_ids

MERGE = 2


@functools.lru_cache(maxsize=1)
def _hf_model():
    """HF Qwen3VLModel on the meta device: get_rope_index needs only its config, no weights."""
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    config = Qwen3VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           deepstack_visual_indexes=[0], num_position_embeddings=16),
        image_token_id=IMAGE_PAD, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
    )  # fmt: skip
    with torch.device("meta"):
        return Qwen3VLModel(config)


def _random_sequence(rng: random.Random, num_images: int) -> tuple[list[int], list[list[int]]]:
    ids: list[int] = [rng.randrange(10, 60) for _ in range(rng.randrange(0, 5))]
    grids = []
    for _ in range(num_images):
        t, h, w = 1, 2 * rng.randrange(1, 12), 2 * rng.randrange(1, 12)
        grids.append([t, h, w])
        ids += [VISION_START] + [IMAGE_PAD] * (t * h * w // 4) + [VISION_END]
        ids += [rng.randrange(10, 60) for _ in range(rng.randrange(0, 6))]
    return ids, grids


@pytest.mark.parametrize("seed", range(12))
def test_positions_and_delta_match_transformers_get_rope_index(seed: int):
    rng = random.Random(seed)
    ids, grids = _random_sequence(rng, num_images=1 + seed % 3)
    grid_thw = torch.tensor(grids)
    ref_pos, ref_delta = _hf_model().get_rope_index(torch.tensor([ids]), mm_token_type_ids(ids), grid_thw)
    positions, next_position = mrope_positions(torch.tensor(ids), grid_thw, IMAGE_PAD, MERGE)
    assert positions.dtype == torch.long and positions.shape == (3, len(ids))
    assert torch.equal(positions, ref_pos[:, 0])
    assert rope_delta(next_position, len(ids)) == int(ref_delta)


def test_worked_example_from_spec():
    """4 text, a 7x5 merged image (grid 14x10), 10 text -> delta -28, text resumes at 11."""
    ids = [1, 2, 3, 4] + [IMAGE_PAD] * 35 + list(range(10, 20))
    positions, next_position = mrope_positions(ids, [[1, 14, 10]], IMAGE_PAD, MERGE)
    assert positions[:, :4].tolist() == [[0, 1, 2, 3]] * 3
    assert positions[0, 4:39].unique().tolist() == [4]
    assert (positions[1, 4:39].min(), positions[1, 4:39].max()) == (4, 10)
    assert (positions[2, 4:39].min(), positions[2, 4:39].max()) == (4, 8)
    assert positions[:, 39].tolist() == [11, 11, 11]
    assert next_position == 21 and rope_delta(next_position, len(ids)) == -28


def test_decode_positions_after_image_follow_transformers_generate_rule():
    """After the prompt, HF decodes at cache_position + rope_delta on all three streams."""
    ids, grids = _random_sequence(random.Random(99), num_images=2)
    _, ref_delta = _hf_model().get_rope_index(torch.tensor([ids]), mm_token_type_ids(ids), torch.tensor(grids))
    _, next_position = mrope_positions(ids, grids, IMAGE_PAD, MERGE)
    delta = rope_delta(next_position, len(ids))
    assert delta < 0
    for step in range(3):
        slot = len(ids) + step
        expected = slot + int(ref_delta)
        assert decode_positions(slot, delta).tolist() == [[expected]] * 3
    slots = torch.arange(len(ids), len(ids) + 4)
    assert torch.equal(decode_positions(slots, torch.tensor(delta)), (slots + int(ref_delta)).expand(3, -1))
    # The first decoded token sits exactly at next_position.
    assert decode_positions(len(ids), delta)[:, 0].tolist() == [next_position] * 3


def test_multi_turn_continuation_equals_whole_sequence():
    """Turn 2 (with its own images) continued from turn 1's next_position == positions of the whole history.

    transformers recomputes get_rope_index over the full history when a new turn brings images, so this
    is also what HF would use; decoded tokens of turn 1 sit at slot + delta = the walk's text positions.
    """
    rng = random.Random(5)
    turn1, grids1 = _random_sequence(rng, num_images=2)
    generated = [rng.randrange(10, 60) for _ in range(7)]
    turn2, grids2 = _random_sequence(rng, num_images=1)
    history = turn1 + generated + turn2
    grid_all = torch.tensor(grids1 + grids2)
    ref_pos, _ = _hf_model().get_rope_index(torch.tensor([history]), mm_token_type_ids(history), grid_all)

    pos1, next1 = mrope_positions(turn1, grids1, IMAGE_PAD, MERGE)
    delta1 = rope_delta(next1, len(turn1))
    gen_pos = torch.cat([decode_positions(len(turn1) + i, delta1) for i in range(len(generated))], dim=1)
    kv_len = len(turn1) + len(generated)
    start2 = kv_len + delta1  # the position the next token would have decoded at
    pos2, next2 = mrope_positions(turn2, grids2, IMAGE_PAD, MERGE, start=start2)
    assert torch.equal(torch.cat([pos1, gen_pos, pos2], dim=1), ref_pos[:, 0])
    whole, next_whole = mrope_positions(history, grid_all, IMAGE_PAD, MERGE)
    assert next2 == next_whole


def test_an_image_pad_id_generated_before_a_continuing_turn_is_text():
    """A model may generate the image-pad id; the next turn feeds the answer's last token first
    (``text_before``): it is text, as transformers' ``mm_token_type_ids`` (which marks images explicitly)
    says, while the turn's own pads still take their image's grid."""
    rng = random.Random(8)
    turn1, grids1 = _random_sequence(rng, num_images=1)
    generated = [rng.randrange(10, 60) for _ in range(3)] + [IMAGE_PAD, IMAGE_PAD]
    pending = [IMAGE_PAD, 7]  # the last sampled token (not in the KV yet), then the answer's end
    turn2, grids2 = _random_sequence(rng, num_images=1)
    history = turn1 + generated[:-1] + pending + turn2
    images = [1 if i == IMAGE_PAD else 0 for i in turn1] + [0] * (len(generated) - 1 + len(pending))
    mm = torch.tensor([images + [1 if i == IMAGE_PAD else 0 for i in turn2]], dtype=torch.int32)
    ref_pos, _ = _hf_model().get_rope_index(torch.tensor([history]), mm, torch.tensor(grids1 + grids2))

    pos1, next1 = mrope_positions(turn1, grids1, IMAGE_PAD, MERGE)
    delta1 = rope_delta(next1, len(turn1))
    decoded = len(generated) - 1  # the generated tokens the KV holds
    gen_pos = torch.cat([decode_positions(len(turn1) + i, delta1) for i in range(decoded)], dim=1)
    start2 = len(turn1) + decoded + delta1
    pos2, _ = mrope_positions(pending + turn2, grids2, IMAGE_PAD, MERGE, start=start2, text_before=len(pending))
    assert torch.equal(torch.cat([pos1, gen_pos, pos2], dim=1), ref_pos[:, 0])
    with pytest.raises(ValueError, match="image_pad"):  # what id equality alone makes of it
        mrope_positions(pending + turn2, grids2, IMAGE_PAD, MERGE, start=start2)


def test_text_only_positions_are_plain_range():
    positions, next_position = mrope_positions(torch.arange(10, 20), None, IMAGE_PAD, MERGE, start=7)
    assert torch.equal(positions, torch.arange(7, 17).expand(3, -1))
    assert next_position == 17
    empty, nxt = mrope_positions([], None, IMAGE_PAD, MERGE, start=3)
    assert empty.shape == (3, 0) and nxt == 3


def test_adjacent_images_without_separator_split_one_run():
    ids = [9] + [IMAGE_PAD] * (4 + 6) + [9]
    positions, _ = mrope_positions(ids, [[1, 4, 4], [1, 4, 6]], IMAGE_PAD, MERGE)
    ref, _ = _hf_model().get_rope_index(
        torch.tensor([[9] + [IMAGE_PAD] * 4 + [9] + [IMAGE_PAD] * 6 + [9]]),
        torch.tensor([[0] + [1] * 4 + [0] + [1] * 6 + [0]]),
        torch.tensor([[1, 4, 4], [1, 4, 6]]),
    )
    # Same image blocks as with a separator token in between (which would take one position).
    assert torch.equal(positions[:, 1:5], ref[:, 0, 1:5])
    assert torch.equal(positions[:, 5:11], ref[:, 0, 6:12] - 1)


@pytest.mark.parametrize(
    ("ids", "grids", "message"),
    [
        ([1] + [IMAGE_PAD] * 4 + [2] + [IMAGE_PAD] * 4, [[1, 4, 4]], "more image-pad tokens than images"),
        ([1] + [IMAGE_PAD] * 4, [[1, 4, 4], [1, 4, 4]], "2 image(s) given"),
        ([1] + [IMAGE_PAD] * 3 + [2], [[1, 4, 4]], "needs 4 <|image_pad|> tokens"),
        ([1] + [IMAGE_PAD] * 5 + [2], [[1, 4, 4]], "more image-pad tokens than images"),
        ([1, 2, 3], [[1, 4, 4]], "1 image(s) given"),
        ([1] + [IMAGE_PAD] * 4, [[1, 3, 4]], "multiples of 2"),
        ([1] + [IMAGE_PAD] * 4, [1, 4, 4], "shape (n, 3)"),
    ],
)
def test_mismatched_images_and_pads_raise_clear_errors(ids, grids, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
        mrope_positions(ids, grids, IMAGE_PAD, MERGE)
