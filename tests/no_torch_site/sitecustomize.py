"""On PYTHONPATH in tests: the modules named in DELTASYNC_TEST_UNIMPORTABLE cannot be imported in
this process (`sys.modules[name] = None`). The variable is removed at once, so the processes this
one starts (vLLM under the serve launcher) import normally: only the parent is held torch-free."""

import os
import sys

for _name in filter(None, os.environ.pop("DELTASYNC_TEST_UNIMPORTABLE", "").split(",")):
    sys.modules[_name.strip()] = None
