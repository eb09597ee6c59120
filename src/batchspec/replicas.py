"""`batchspec.replicas:app`: the Ray Serve application builder that Serve config files name, with
`args: {argv: "<batchspec serve options>"}` (docs/scale-out.md). The options are parsed and
checked as the command line does, then deployed as `batchspec serve --replicas` would."""

from __future__ import annotations

import shlex

from . import cli


def app(builder_args: dict):
    """The bound replicas of `argv`: `args: {argv: "--pair tiny --replicas 2"}`."""
    from .serving.replicas import deployment

    args = cli.build_parser().parse_args(["serve", *shlex.split(str(builder_args.get("argv", "")))])
    return deployment(cli.serve_config(args))
