"""CPU harness that runs the CUDA kernels of ``kernels/`` unchanged (see harness.py)."""
