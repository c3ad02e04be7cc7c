"""`python -m fedvl.cli`."""

import sys

from fedvl.cli import main

sys.exit(main())
