"""One module per `aioready` subcommand: `add_parser(subparsers)` and `run(args) -> int`."""
