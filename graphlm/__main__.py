"""``python -m graphlm ...`` is the `graphlm` command (graphlm/tools/cli.py)."""
import sys

from graphlm.tools.cli import main

sys.exit(main())
