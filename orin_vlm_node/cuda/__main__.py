"""``python -m orin_vlm_node.cuda``: the CUDA diagnostics report (see ``diagnostics``)."""

import sys

from .diagnostics import main

sys.exit(main())
