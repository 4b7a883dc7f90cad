"""`aioready hints`: print a hint order for a pipeline shape."""

from __future__ import annotations

import argparse

from ..schedulers import hint_names, make_hint

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "hints", help="print a hint order",
        description="Print the per-rank order of a hint, its peak in-flight count per rank "
        "(the default cap) and the activation memory that implies.",
        epilog="examples:\n  aioready hints --stages 4 --microbatches 8 --hint 1f1b\n"
        "  aioready hints --stages 4 --microbatches 8 --hint gpipe --split-backward",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, required=True, help="number of pipeline stages S")
    p.add_argument("--microbatches", type=int, required=True, help="microbatches per step M")
    p.add_argument("--hint", default="1f1b", help=f"one of {', '.join(hint_names())} or a file")
    p.add_argument("--ranks", type=int, default=None, help="ranks (default: from the hint)")
    p.add_argument("--split-backward", action="store_true", help="separate B and W tasks")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    hint = make_hint(args.hint, num_stages=args.stages, num_ranks=args.ranks,
                     num_microbatches=args.microbatches, split_backward=args.split_backward)
    print(hint.dumps(), end="")
    caps = hint.default_caps or ()
    for rank, cap in enumerate(caps):
        print(f"# rank {rank}: default cap {cap} microbatches in flight "
              f"(= {cap} x one microbatch's activations of {hint.placement.num_chunks} chunk(s))")
    return 0
