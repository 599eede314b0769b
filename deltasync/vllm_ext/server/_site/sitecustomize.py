"""Put on PYTHONPATH by `deltasync.vllm_ext.serve` so that every process vLLM starts (engine,
workers, its `python -m ...registry` probe) hides the modules named in DELTASYNC_BLOCK_MODULES."""

import os
import sys

for _name in filter(None, os.environ.get("DELTASYNC_BLOCK_MODULES", "").split(",")):
    sys.modules.setdefault(_name.strip(), None)  # import fails, importlib.util.find_spec -> None
