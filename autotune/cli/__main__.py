"""`python -m autotune.cli`."""

import sys

from autotune.cli import main

sys.exit(main())
