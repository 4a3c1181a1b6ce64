"""``python -m attnprof.plugin.cli``: the same as the ``attnprof`` console script."""

import sys

from attnprof.plugin.cli import main

sys.exit(main())
