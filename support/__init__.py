"""What the tests, the demo, the benchmarks and the GPU check share (never installed with the package).

* :mod:`support.checkpoints`: random-weight Qwen3-VL checkpoints written by transformers (tiny ones for
  parity tests, the 2B's attention shape, every dimension of a real config) and the inputs that go with them.
* :mod:`support.quantized_copies`: those checkpoints stored as published quantized checkpoints store them
  (FP8, compressed-tensors integers, AutoAWQ, GPTQ).
* :mod:`support.tokenizer`: the tiny byte-level tokenizer those checkpoints use.
* :mod:`support.node_process`: the node as a child process (own process group, localhost-only DDS, a
  private domain and log directory), stopped the way ``ros2 launch`` stops it.
* :mod:`support.node_client`: an rclpy client that publishes images and prompts and records what the node
  says (status events, tokens, responses, diagnostics), with predicate waits instead of sleeps.
* :mod:`support.scene_drawing`: pictures of coloured shapes with their label maps, and their layouts.
* :mod:`support.synthetic_scenes`: the questions and answers about those pictures the default model is
  trained on (the demo, the training, the tests and the benchmarks draw from it).
* :mod:`support.scene_formats`: the same pictures asked for in a format (Qwen3-VL grounding, a JSON list of
  the shapes), and how such answers are scored.
"""
