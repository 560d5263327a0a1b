"""``python -m meshsim``: the ``meshsim`` command (``run``, ``demo``)."""

import sys

from meshsim._cli import main

if __name__ == "__main__":
    sys.exit(main())
