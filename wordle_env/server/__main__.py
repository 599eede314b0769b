"""``python -m wordle_env.server``: the same entry point as ``wordle_env.server.app:main``."""

from wordle_env.server.app import main

if __name__ == "__main__":
    main()
