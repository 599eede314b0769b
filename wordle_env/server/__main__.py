"""Run the Wordle server.

    python -m wordle_env.server                            # 127.0.0.1:8002, local mode
    MAX_CONCURRENT_ENVS=512 python -m wordle_env.server --host 0.0.0.0 --port 8000

Session capacity comes from ``MAX_CONCURRENT_ENVS`` (default 256); ``ENABLE_WEB_INTERFACE=true``
adds OpenEnv's Gradio page at ``/web``.
"""

from __future__ import annotations

import argparse
import os

import uvicorn

from wordle_env.server.app import DEFAULT_MAX_CONCURRENT_ENVS, create_wordle_app

# Frames are tiny (a guess is capped at 256 characters); refuse megabyte frames outright.
_WS_MAX_FRAME_BYTES = 1 << 20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m wordle_env.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    args = parser.parse_args(argv)
    raw = os.environ.get("MAX_CONCURRENT_ENVS", str(DEFAULT_MAX_CONCURRENT_ENVS))
    if not raw.isdigit() or int(raw) < 1:
        parser.error(f"MAX_CONCURRENT_ENVS must be a positive integer, got {raw!r}")
    app = create_wordle_app(int(raw))
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        ws_max_size=_WS_MAX_FRAME_BYTES,
    )


if __name__ == "__main__":
    main()
