"""3-D RoPE positions of a Qwen3-VL token sequence, and the decode positions that follow it.

Dual position tracking (docs/architecture.md): a token has a KV *slot* (0, 1, 2, ... — cache placement and
causal mask, owned by the KV backend) and a RoPE *position* (t, h, w — owned here). Text advances all
three streams by 1 per token; an image of merged grid H'xW' takes positions (cur, cur+hi, cur+wi)
and then advances ``cur`` by only ``max(H', W')``, so after an image the RoPE position runs behind the
slot. Decoding therefore uses ``position = slot + rope_delta`` with ``rope_delta = next_position - kv_len``
(usually negative); using the KV length as the position after an image is the classic bug
(docs/architecture.md, pitfall 2). A video's frame groups are each positioned like an image of one
temporal slice (its time is in the timestamp text before each group, not in the positions).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mrope_positions(
    token_ids: torch.Tensor | Sequence[int],
    image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None,
    image_token_id: int | Sequence[int],
    spatial_merge_size: int,
    start: int = 0,
    text_before: int = 0,
) -> tuple[torch.Tensor, int]:
    """RoPE positions (3, L) long (CPU) for ``token_ids`` and the position the next token gets.

    Every maximal run of ``image_token_id`` (or of any of several pad ids: image and video pads) consumes
    the next rows of ``image_grid_thw`` (t, h, w in 16-px patches) in order; a run must hold exactly
    ``t*h*w / merge^2`` tokens per image it covers (adjacent images with no separator are allowed).
    ``start`` continues an earlier sequence: pass the previous call's ``next_position`` (multi-turn).
    ``next_position`` is ``max(position) + 1`` (the position HF decodes the next token at), or ``start``
    for an empty sequence. The first ``text_before``
    ids are text whatever their value: a continuing turn first feeds the tokens the previous answer ended
    with, and a model may have generated the image-pad id there.

    Raises ``ValueError`` when runs and images do not match (too many / too few images, wrong run
    length, a grid not divisible by the merge size).
    """
    ids = torch.as_tensor(token_ids).reshape(-1).to("cpu", torch.long)
    grids = _grid_list(image_grid_thw, spatial_merge_size)
    length = ids.numel()
    positions = torch.empty((3, length), dtype=torch.long)
    is_image = torch.isin(ids, torch.as_tensor(image_token_id, dtype=torch.long).reshape(-1))
    is_image[:text_before] = False
    # Boundaries of runs of equal "is image" value: [0, b1, b2, ..., L].
    change = torch.nonzero(is_image[1:] != is_image[:-1]).reshape(-1) + 1
    bounds = [0, *change.tolist(), length] if length else [0]
    cur = start
    highest = start - 1
    next_grid = 0
    for begin, end in zip(bounds[:-1], bounds[1:], strict=True):
        if not bool(is_image[begin]):
            positions[:, begin:end] = torch.arange(cur, cur + end - begin).unsqueeze(0)
            cur += end - begin
            highest = cur - 1
            continue
        next_grid, cur, top = _image_run(positions, begin, end, grids, next_grid, cur, spatial_merge_size)
        highest = max(highest, top)
    if next_grid != len(grids):
        raise ValueError(
            f"{len(grids)} image(s) given but the prompt's <|image_pad|> runs cover only {next_grid} "
            "(an image placeholder is missing or was not expanded)"
        )
    return positions, highest + 1


def _image_run(
    positions: torch.Tensor,
    begin: int,
    end: int,
    grids: list[tuple[int, int, int]],
    next_grid: int,
    cur: int,
    merge: int,
) -> tuple[int, int, int]:
    """Fill ``positions[:, begin:end]``, a run of image pads (one image or several adjacent ones) from
    ``grids[next_grid]`` on; return (next unused grid, position after the run, highest position)."""
    offset = begin
    highest = cur - 1
    while offset < end:
        if next_grid >= len(grids):
            raise ValueError(
                f"prompt has more image-pad tokens than images: {end - offset} <|image_pad|> tokens at "
                f"positions {offset}..{end - 1} have no image left ({len(grids)} image(s) given)"
            )
        t, gh, gw = grids[next_grid]
        count = t * gh * gw
        if offset + count > end:
            raise ValueError(
                f"image {next_grid} (grid t={t}, h={gh * merge}, w={gw * merge}) "
                f"needs {count} <|image_pad|> tokens but its run at position {offset} has only {end - offset}"
            )
        ti, hi, wi = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        block = torch.stack((ti.reshape(-1), hi.reshape(-1), wi.reshape(-1))) + cur  # (3, count)
        positions[:, offset : offset + count] = block
        highest = max(highest, int(block.max()))
        cur += max(gh, gw)
        offset += count
        next_grid += 1
    return next_grid, cur, highest


def rope_delta(next_position: int, kv_len: int) -> int:
    """Offset from KV slot to RoPE position for tokens after the prompt (usually <= 0)."""
    return next_position - kv_len


def decode_positions(slot: int | torch.Tensor, rope_delta: int | torch.Tensor, device=None) -> torch.Tensor:
    """(3, n) long RoPE positions of the tokens at KV slot(s) ``slot`` (int or (n,) tensor).

    All three streams equal ``slot + rope_delta``. With tensor inputs on the device this is pure
    device math (no host sync), so it can live inside a captured decode graph.
    """
    if isinstance(slot, torch.Tensor):
        pos = (slot.reshape(-1).to(torch.long) + rope_delta).to(device or slot.device)
    else:
        delta = rope_delta if isinstance(rope_delta, int) else int(rope_delta)
        pos = torch.tensor([slot + delta], dtype=torch.long, device=device)
    return pos.unsqueeze(0).expand(3, -1)


def _grid_list(image_grid_thw, merge: int) -> list[tuple[int, int, int]]:
    """Rows (t, h/merge, w/merge) as Python ints, validated."""
    if image_grid_thw is None:
        return []
    grid = torch.as_tensor(image_grid_thw).to("cpu")
    if grid.numel() == 0:
        return []
    if grid.dim() != 2 or grid.shape[1] != 3:
        raise ValueError(f"image_grid_thw must have shape (n, 3), got {tuple(grid.shape)}")
    rows = []
    for i, (t, h, w) in enumerate(grid.tolist()):
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(
                f"image_grid_thw row {i} = {[t, h, w]}: need t >= 1 and h, w positive multiples of {merge}"
            )
        rows.append((int(t), int(h) // merge, int(w) // merge))
    return rows
