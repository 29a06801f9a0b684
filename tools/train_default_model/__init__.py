"""Train the embedded default model: a tiny Qwen3-VL that answers questions about synthetic shape scenes,
which way a shape moved in short clips it gets as video, locates the shapes in Qwen3-VL's grounding format and
lists them as JSON.

Why this exists: the package must ship a model that runs out of the box, on any machine, without downloads,
and that demonstrably uses the picture. Real Qwen3-VL weights cannot be bundled (size, licence, no network),
so this package builds a few-million-parameter model with the *exact* Qwen3-VL architecture
(``transformers.Qwen3VLForConditionalGeneration``: vision tower with DeepStack, interleaved M-RoPE, tied
embeddings) and trains it on the CPU on ``support/synthetic_scenes.py``, ``support/scene_videos.py`` and
``support/scene_formats.py``. It is
a DEMO model, not Qwen3-VL.

Pixels are produced by the runtime's own ``orin_vlm_node.processing`` image and video processors so training and
inference see identical inputs. The result is written in Hugging Face format (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, chat_template.jinja, preprocessor_config.json,
video_preprocessor_config.json, generation_config.json).

Modules: ``recipe`` (what determines the weights: ``TrainConfig``, schedule, sample draws), ``vocabulary``
(tokenizer, chat template), ``checkpoint_files`` (configs, bf16 save), ``batches`` (pixels and token ids as
the runtime builds them), ``dense_targets``, ``motion_targets``, ``numbers``, ``presence``, ``pointer`` and
``decisions`` (the auxiliary losses and their targets), ``training`` (the two stages, and fine-tunes), ``evaluation``
(transformers' generate as the reference, grounding and shape lists included).

The commands that produced the committed checkpoint, with their wall times, are in its model card
(``orin_vlm_node/default_model/README.md``, "Training"). Evaluate a checkpoint with transformers' generate:
    .venv/bin/python -m tools.train_default_model --eval-only --out orin_vlm_node/default_model"""
