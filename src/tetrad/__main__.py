"""`python -m tetrad ...` (what torchrun runs: `torchrun ... -m tetrad train CONFIG`)."""

import sys

from tetrad.cli import main

sys.exit(main())
