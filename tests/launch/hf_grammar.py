"""Parse a command line with the real `hf` CLI's click parser (huggingface_hub 2.4), offline.

Resolves each group and subcommand like `hf` does, then parses the leaf's options and arguments
without invoking it: an unknown command or option, a missing argument or a bad value raises
`click.ClickException` exactly as the real CLI would before doing anything.
"""

from __future__ import annotations

from typing import Any

import click


def parse_hf(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """(command path, parsed parameters) of `hf <argv>`."""
    from huggingface_hub.cli.hf import app

    ctx = app.make_context("hf", list(argv))
    command: click.Command = app
    while isinstance(command, click.Group):
        name, sub, rest = command.resolve_command(ctx, [*ctx._protected_args, *ctx.args])
        if sub is None:
            raise click.UsageError(f"no such command {name!r}")
        ctx = sub.make_context(name, rest, parent=ctx)
        command = sub
    for param in command.params:  # the CLI's arguments do not all enforce `required` themselves
        if param.required and ctx.params.get(param.name) in (None, ()):
            raise click.MissingParameter(ctx=ctx, param=param)
    return ctx.command_path, dict(ctx.params)
