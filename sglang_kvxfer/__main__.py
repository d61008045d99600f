"""``python -m sglang_kvxfer`` is the ``kvxfer`` command."""

import sys

from sglang_kvxfer.cli import main

sys.exit(main())
