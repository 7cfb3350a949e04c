"""``python -m tools ...`` is the `graphlm` command."""
import sys

from .cli import main

sys.exit(main())
