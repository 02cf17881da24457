"""`python -m rudder.pipeline CONFIG_JSON`: one spawned pipeline stage (see stage.py)."""

import sys

from .stage import main

sys.exit(main(sys.argv[1:]))
