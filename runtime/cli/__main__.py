"""``python -m s4kv.runtime.cli``: the ``s4kv`` command."""

import sys

from s4kv.runtime.cli import main

sys.exit(main())
