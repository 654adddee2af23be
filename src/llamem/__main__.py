"""`python -m llamem` runs the command line."""

import sys

from llamem.cli import main

sys.exit(main())
