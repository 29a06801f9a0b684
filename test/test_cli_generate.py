"""``python -m orin_vlm_node.generate``: streaming and JSON output, exit codes, clear input errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from test_engine_streaming import SCRIPT, _scripted

from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn, output_format
from orin_vlm_node.generate import main
from support.checkpoints import cached_tiny_checkpoint

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
CHECKPOINT = dict(layers=2, deepstack=(0, 1), tie=True, seed=21)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "orin_vlm_node.generate", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """Built before a test captures its output: a first build in the process prints transformers' progress."""
    return cached_tiny_checkpoint(**CHECKPOINT)


@pytest.fixture(scope="module")
def image_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "frame.png"
    rgb = np.random.default_rng(7).integers(0, 256, (120, 160, 3), dtype=np.uint8)
    rgb[:, :80] = (200, 30, 30)  # a red left half, so channel order matters
    cv2.imwrite(str(path), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    return path


def test_image_prompt_json_matches_engine(image_file, tiny_model):
    model = tiny_model
    args = ["--model-path", str(model), "--image", str(image_file), "--prompt", "Describe this image."]
    args += ["--temperature", "0", "--max-new-tokens", "16", "--page-size", "4", "--device", "cpu", "--json"]
    proc = _cli(*args)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"text", "token_ids", "finish_reason", "metrics", "backend"}
    assert out["finish_reason"] in ("stop", "length") and 0 < len(out["token_ids"]) <= 16
    # Which attention path ran, and the KV pool's size and why (one request, no kept conversation).
    assert out["backend"]["kernels"] == "kernels: off (cpu device)"
    assert out["backend"]["decode_path"] == "torch reference (dynamic step)"
    assert "(auto: 1 x 4096-token context + 25% prefix-cache share)" in out["backend"]["kv_pool"]
    assert out["metrics"]["prompt_tokens"] > 20  # the image's tokens are in the prompt
    # Same request through the engine with the RGB image: the CLI's BGR read path gives the same ids.
    rgb = cv2.cvtColor(cv2.imread(str(image_file)), cv2.COLOR_BGR2RGB)
    engine = Engine(EngineConfig(model_path=str(model), page_size=4))
    request = Request(Turn("Describe this image.", (rgb,)), SamplingParams(temperature=0.0, max_new_tokens=16))
    final = list(engine.generate(request))[-1]
    assert out["token_ids"] == list(final.token_ids) and out["text"] == final.text


def test_streams_text_to_stdout(tmp_path_factory, capsys):
    model, _ = _scripted(str(tmp_path_factory.getbasetemp()))
    code = main(
        [
            "--model-path",
            model,
            "--prompt",
            "Say hello.",
            "--temperature",
            "0",
            "--no-use-paged-attention",
            "--system-prompt",
            "Be nice.",
        ]
    )
    assert code == 0
    assert capsys.readouterr().out == SCRIPT + "\n"


@pytest.mark.parametrize(
    "extra,fragment",
    [
        (["--image", "/nonexistent/frame.png"], "does not exist"),
        (["--image", "GARBAGE"], "cannot read image file"),
        (["--top-p", "1.5"], "top_p"),
        (["--temperature", "-1"], "temperature"),
        (["--page-size", "3"], "power of two"),
        (["--image", "TINY"], "image 0"),
    ],
)
def test_bad_input_exits_nonzero_with_message(tmp_path, capsys, tiny_model, extra, fragment):
    model = tiny_model
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"not a png at all")
    tiny = tmp_path / "tiny.png"
    cv2.imwrite(str(tiny), np.zeros((2, 600, 3), np.uint8))  # aspect ratio the processor refuses
    extra = [str(garbage) if a == "GARBAGE" else str(tiny) if a == "TINY" else a for a in extra]
    code = main(["--model-path", str(model), "--prompt", "Hi", "--max-new-tokens", "2", *extra])
    err = capsys.readouterr().err
    assert code == 1
    assert fragment in err and err.startswith("error:")


def test_missing_model_directory(tmp_path, capsys):
    assert main(["--model-path", str(tmp_path / "nothing"), "--prompt", "Hi"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_prompt_is_required(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--model-path", "x"])
    assert exc.value.code == 2 and "--prompt" in capsys.readouterr().err


def test_every_engine_and_sampling_setting_is_a_flag_with_the_node_default():
    """The flags come from the settings schema: same names, defaults and choices as the node's parameters."""
    from orin_vlm_node import settings
    from orin_vlm_node.generate import build_parser

    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    for s in settings.SETTINGS:
        if s.consumer == "node" and s.name != "system_prompt":
            assert s.name not in actions, s.name  # queue, camera, conversation: the node's alone
            continue
        assert s.flag in actions[s.name].option_strings and actions[s.name].default == s.default, s.name
        if s.choices:
            assert tuple(actions[s.name].choices) == s.choices
    args = parser.parse_args(["--prompt", "x", "--page-size", "32", "--no-use-cuda-graph", "--kv-pool-mb", "64"])
    assert (args.page_size, args.use_cuda_graph, args.kv_pool_mb) == (32, False, 64)


def test_an_output_format_flag_constrains_the_answer_and_json_carries_its_value(tmp_path, capsys, tiny_model):
    """--choice, --regex and --json-schema (inline or a file) give the engine's constrained answer; --json
    carries the parsed value."""
    model = str(tiny_model)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    common = ["--model-path", model, "--prompt", "How many?", "--temperature", "0", "--device", "cpu", "--json"]
    cases = [
        (["--choice", "yes", "--choice", "no"], output_format("choice", ["yes", "no"])),
        (["--regex", "[0-9]{2}"], output_format("regex", "[0-9]{2}")),
        (["--json-schema", json.dumps(schema)], output_format("json_schema", schema)),
        (["--json-schema", str(tmp_path / "schema.json")], output_format("json_schema", schema)),
    ]
    engine = Engine(EngineConfig(model_path=model, device="cpu", max_sessions=0, max_batch=1))
    for flags, fmt in cases:
        assert main([*common, *flags]) == 0
        out = json.loads(capsys.readouterr().out)
        want = list(engine.generate(Request(Turn("How many?"), SamplingParams(temperature=0.0), output=fmt)))[-1]
        assert out["text"] == want.text and out["output"] == want.output and want.output["complete"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--regex", "(["], "invalid regex"),
        (["--json-schema", "{oops"], "json_schema is not valid JSON"),
        (["--choice", ""], "choice needs a list of non-empty strings"),
    ],
)
def test_an_output_format_that_cannot_work_exits_1_naming_why(flags, message, capsys, tiny_model):
    args = ["--model-path", str(tiny_model), "--prompt", "Hi", "--device", "cpu", *flags]
    assert main(args) == 1
    assert message in capsys.readouterr().err
