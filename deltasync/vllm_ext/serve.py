"""`python -m deltasync.vllm_ext.serve`, the rollout server's stable command line; the code is
`deltasync.vllm_ext.server.serve`."""

import sys

from deltasync.vllm_ext.server.serve import main

if __name__ == "__main__":
    sys.exit(main())
