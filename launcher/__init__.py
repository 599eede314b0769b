"""What `launch.py` does: provision Spaces with the `hf` CLI, or run every part locally.

Modules: `hf` (the CLI as a subprocess), `plan` (names and settings), `staging` (build
contexts), `spaces` (create, update, tear down), `progress` (wait until Spaces run), `remote`
(train against them), `local` and `supervisor` (`--local`), `commands` (the parts' command lines).
"""

from .config import LocalConfig, SpacesConfig
from .errors import LaunchError

__all__ = ["LaunchError", "LocalConfig", "SpacesConfig"]
