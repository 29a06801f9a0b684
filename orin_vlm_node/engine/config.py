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
    kv_pool_mb: float = 0.0  # > 0 sizes the pool in MB; both 0: sized by need (see kvcache.config)
    kv_prefix_share: float = 0.25  # automatic size: extra share of blocks for cached prefixes
    kv_memory_reserve_mb: int = 1024  # automatic size: memory left free for the rest of the system
    max_sessions: int = 1  # conversations kept between requests (LRU beyond); sizes the pool too
    prefix_caching: bool = True
    # CUDA
    use_cuda_kernels: bool = True
    use_cuda_graph: bool = True
    allow_kernel_fallback: bool = True  # False: kernels requested but unavailable is a startup error
    kernel_dir: str = ""  # "" = the kernel sources of this install (see cuda.sources)
    kernel_cache_dir: str = ""  # "" = ~/.cache/orin_vlm_node/kernels
    # limits and defaults
    max_context_tokens: int = 4096
    image_min_pixels: int = 0  # 0 = the checkpoint's preprocessor_config.json value
    image_max_pixels: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
