"""``python -m attnprof.cli``: the same as the ``attnprof`` console script."""

import sys

from attnprof.cli import main

sys.exit(main())
