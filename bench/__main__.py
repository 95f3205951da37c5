"""`python -m bench`: the same as `diffbatch bench`."""

import sys

from bench.cli import main

sys.exit(main())
