"""Engine configuration: one dataclass, the single place every engine setting is defined.

The ROS node maps its parameters 1:1 onto these fields, the CLI maps its flags onto them, and
``Engine.reconfigure`` takes a subset of them by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .events import SamplingParams

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "default_model"


@dataclass
class EngineConfig:
    model_path: str = str(DEFAULT_MODEL_DIR)
    device: str = "auto"  # auto | cuda | cpu
    dtype: str = "auto"  # auto | bf16 | fp16 | fp32 (auto: the checkpoint's on CUDA, fp32 on CPU)
    # KV cache
    use_paged_attention: bool = True
    page_size: int = 16  # tokens per block, power of two in 1..256
    kv_pool_blocks: int = 0  # > 0 sizes the pool in blocks (wins over kv_pool_mb)
    kv_pool_mb: float = 0.0  # > 0 sizes the pool in MB; both 0: a fraction of free memory / max context
    prefix_caching: bool = True
    # CUDA
    use_cuda_kernels: bool = True
    use_cuda_graph: bool = True
    # Static-buffer decode step (what a CUDA graph captures): "auto" = only where a graph is captured
    # (CUDA with use_cuda_graph); "on" = also eagerly on CPU (tests of the graph logic); "off" = never.
    # On CPU the static step attends over the whole max-context width every token, so "auto" skips it.
    static_decode: str = "auto"
    kernel_cache_dir: str = ""  # "" = ~/.cache/orin_vlm_node/kernels
    # limits and defaults
    max_context_tokens: int = 4096
    image_min_pixels: int = 0  # 0 = the checkpoint's preprocessor_config.json value
    image_max_pixels: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
