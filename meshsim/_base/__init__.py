"""What every layer shares: the rank context, the errors, what ranks wait on.

``MESHSIM_DIR`` is where meshsim's own files are: tracebacks, stacks and call sites
leave out the frames of files under it.
"""

import os

MESHSIM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
