"""``python -m graphlm.tools ...`` is the `graphlm` command, as ``python -m graphlm`` is."""
import sys

from .cli import main

sys.exit(main())
