"""The dashboard Space's entry point, staged by launch.py as the Space's `app.py`.

Gradio Spaces run `python app.py` (the README's `app_file`) from the Space's root, which holds
this file, `deltasync/` (its torch-free core is all the dashboard imports) and the dashboard
package as `deltasync_dashboard/` (in this repository: `spaces/dashboard/`; renamed because the
Spaces runtime installs a `spaces` package of its own). The bucket comes from the Space variable
`DELTASYNC_BUCKET` (and, for a private `hf://` bucket, the secret `HF_TOKEN`); Spaces set
`GRADIO_SERVER_NAME` and `GRADIO_SERVER_PORT`.
"""

from __future__ import annotations

import os
import sys

from deltasync_dashboard.app import main

if __name__ == "__main__":
    host = os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0")
    port = os.environ.get("GRADIO_SERVER_PORT", "7860")
    sys.exit(main(["--host", host, "--port", port]))
