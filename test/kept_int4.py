"""What the tests of checkpoints stored as 4-bit integers (compressed-tensors, AWQ, GPTQ) share: the engine run
on such a checkpoint twice, its weights kept as the node's INT4 and widened to fp32."""

from __future__ import annotations

from pathlib import Path

from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn

REQUEST = Request(Turn("Tell the robot what to do next."), SamplingParams(temperature=0.0, max_new_tokens=24))


def kept_and_widened(ckpt: Path, group_size: int) -> dict[str, tuple[list[int], dict]]:
    """mode ("int4": kept as stored, "none": widened) -> (the greedy answer's token ids, ``Engine.describe()``),
    with the LM head in fp32 both ways and ``group_size`` the setting's groups; every answer ends without error."""
    runs = {}
    for mode in ("int4", "none"):
        cfg = EngineConfig(model_path=str(ckpt), device="cpu", dtype="fp32", weight_quant=mode,
                           weight_quant_group_size=group_size, weight_quant_lm_head=False)  # fmt: skip
        engine = Engine(cfg)
        final = list(engine.generate(REQUEST))[-1]
        assert final.error is None, final.error
        runs[mode] = (final.token_ids, engine.describe())
    return runs
