"""What a Dockerfile takes from its build context, without a Docker engine.

The Dockerfile is parsed by BuildKit's own parser (the `dockerfile` package). `image_of` replays
WORKDIR and COPY/ADD over a staged context into a map of image paths to context paths, raising
`ContextError` for a source the context lacks; `pip_installs` finds what each RUN pip-installs.
"""

from __future__ import annotations

import posixpath
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import dockerfile

__all__ = ["ContextError", "Image", "PipInstall", "commands", "image_of", "pip_installs"]

# pip / uv pip install options that take a value (the value is not a requirement)
_VALUE_OPTIONS = {
    "-r", "--requirement", "-c", "--constraint", "-e", "--editable", "-i", "--index-url",
    "--extra-index-url", "-f", "--find-links", "-t", "--target", "--prefix", "--root",
    "-p", "--python", "--python-version", "--platform", "--only-binary", "--no-binary",
    "--trusted-host", "--cache-dir", "--src", "--upgrade-strategy", "--progress-bar",
    "--index-strategy", "--override", "--build-constraint", "--config-settings", "-C",
}  # fmt: skip
_SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", "then", "else", "do", "fi", "done", "!"}


class ContextError(AssertionError):
    """The Dockerfile asks for something its staged context does not hold."""


@dataclass
class Image:
    """What the build put where: (image path, context file or folder) in COPY order."""

    layers: list[tuple[PurePosixPath, Path]] = field(default_factory=list)

    def find(self, path: PurePosixPath) -> Path | None:
        """The context file or folder at `path` in the image (the last COPY wins)."""
        for dest, src in reversed(self.layers):
            if path == dest:
                return src
            if src.is_dir() and dest in path.parents:
                candidate = src / path.relative_to(dest)
                if candidate.exists():
                    return candidate
        return None

    def materialize(self, folder: PurePosixPath, into: Path) -> Path:
        """Copy what the image holds under `folder` into `into` (what `pip install` sees)."""
        into.mkdir(parents=True, exist_ok=True)
        for dest, src in self.layers:
            if dest == folder or folder in dest.parents:
                target = into / dest.relative_to(folder)
                source = src
            elif dest in folder.parents and src.is_dir():
                target, source = into, src / folder.relative_to(dest)
                if not source.is_dir():
                    continue
            else:
                continue
            if source.is_dir():
                shutil.copytree(source, target, dirs_exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
        return into


@dataclass(frozen=True)
class PipInstall:
    """One `pip install` (or `uv pip install`) of a RUN, with the working folder it ran in."""

    line: int
    cwd: PurePosixPath
    requirement_files: tuple[str, ...]
    local: tuple[str, ...]  # paths: `.`, `./pkg`, `-e .`, wheels
    named: tuple[str, ...]  # requirements by name (from an index)


def commands(path: Path) -> tuple[dockerfile.Command, ...]:
    return dockerfile.parse_file(str(path))


def image_of(path: Path, context: Path) -> tuple[Image, list[tuple[dockerfile.Command, str]]]:
    """Replay the final stage's COPY/ADD over `context`; also each RUN with its working folder."""
    image, runs = Image(), []
    cwd = PurePosixPath("/")
    for cmd in commands(path):
        if cmd.cmd == "FROM":  # a new stage starts from its base image
            image, runs, cwd = Image(), [], PurePosixPath("/")
        elif cmd.cmd == "WORKDIR":
            cwd = _resolve(cwd, cmd.value[0])
        elif cmd.cmd in ("COPY", "ADD"):
            if any(f.startswith("--from=") for f in cmd.flags):
                continue  # from another stage, not from the context
            _copy(image, cmd, cwd, context)
        elif cmd.cmd == "RUN":
            runs.append((cmd, str(cwd)))
    return image, runs


def pip_installs(cmd: dockerfile.Command, cwd: str) -> list[PipInstall]:
    """Every pip install in a RUN (shell form, JSON form and heredocs)."""
    script = shlex.join(cmd.value) if cmd.json else " ".join(cmd.value)
    script = "\n".join([script, *(h.content for h in cmd.heredocs)])
    lexer = shlex.shlex(script.replace("\n", " ; "), posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    found, current = [], []
    for token in [*lexer, ";"]:
        if token in _SEPARATORS or set(token) <= set(";&|()"):
            install = _install_args(current)
            if install is not None:
                found.append(_classify(install, cmd.start_line, PurePosixPath(cwd)))
            current = []
        else:
            current.append(token)
    return found


def _resolve(cwd: PurePosixPath, path: str) -> PurePosixPath:
    return PurePosixPath(posixpath.normpath(posixpath.join(str(cwd), path)))


def _copy(image: Image, cmd: dockerfile.Command, cwd: PurePosixPath, context: Path) -> None:
    *sources, dest = cmd.value
    into_folder = dest.endswith("/") or dest in (".", "..") or len(sources) > 1
    dest_path = _resolve(cwd, dest)
    for source in sources:
        if source.startswith(("http://", "https://", "git@")):
            raise ContextError(f"line {cmd.start_line}: {cmd.cmd} {source} fetches at build time")
        clean = posixpath.normpath(source)
        if clean.startswith("..") or clean.startswith("/"):
            raise ContextError(f"line {cmd.start_line}: {source} is outside the build context")
        matches = sorted(context.glob(clean)) if clean != "." else [context]
        if not matches:
            raise ContextError(
                f"line {cmd.start_line}: {cmd.cmd} {source}: not in the staged context "
                f"(it holds {sorted(p.name for p in context.iterdir())})"
            )
        for match in matches:
            if match.is_dir():  # a folder's contents go to dest
                image.layers.append((dest_path, match))
            elif into_folder:
                image.layers.append((dest_path / match.name, match))
            else:
                image.layers.append((dest_path, match))


def _install_args(tokens: list[str]) -> list[str] | None:
    """The arguments after `install` when `tokens` runs pip (`pip`, `pip3`, `python -m pip`,
    `uv pip`, after any `VAR=value` or `env`), else None."""
    for i, word in enumerate(tokens[:-1]):
        name = PurePosixPath(word).name
        if name in ("pip", "pip3"):
            rest = tokens[i + 1 :]
        elif name == "uv" and tokens[i + 1] == "pip":
            rest = tokens[i + 2 :]
        else:
            continue
        return rest[1:] if rest[:1] == ["install"] else None
    return None


def _classify(args: list[str], line: int, cwd: PurePosixPath) -> PipInstall:
    files, local, named = [], [], []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in _VALUE_OPTIONS and i + 1 < len(args):
            value = args[i + 1]
            if arg in ("-r", "--requirement"):
                files.append(value)
            elif arg in ("-e", "--editable"):
                local.append(value)
            i += 2
            continue
        if not arg.startswith("-"):
            is_path = arg.startswith((".", "/")) or arg.endswith((".whl", ".tar.gz", ".zip"))
            (local if is_path else named).append(arg)
        i += 1
    return PipInstall(line, cwd, tuple(files), tuple(local), tuple(named))
