"""`aioready hints`: print a hint order for a pipeline shape, its caps and what they cost."""

from __future__ import annotations

import argparse

from ..hints import HintOrder
from ..schedulers import hint_names, make_hint

__all__ = ["add_parser", "run", "describe"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "hints", help="print a hint order",
        description="Print the per-rank order of a hint (the text form a hint file uses), its "
        "default cap per rank (an order's own peak in-flight count; a rule's documented cap) "
        "and the activation memory that implies. A rule also prints the sequence strict mode "
        "runs (derived by list-scheduling the rule under unit durations).",
        epilog="examples:\n  aioready hints --stages 4 --microbatches 8 --hint 1f1b\n"
        "  aioready hints --stages 8 --microbatches 8 --hint zbv --split-backward\n"
        "  aioready hints --stages 4 --microbatches 8 --hint bfw --split-backward\n"
        "  aioready hints --stages 8 --microbatches 8 --torch InterleavedZeroBubble\n"
        "  aioready hints --stages 4 --microbatches 8 --hint my_order.txt",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, required=True, help="number of pipeline stages S")
    p.add_argument("--microbatches", type=int, required=True, help="microbatches per step M")
    p.add_argument("--hint", default="1f1b", help=f"one of {', '.join(hint_names())} or a file")
    p.add_argument("--ranks", type=int, default=None, help="ranks (default: from the hint)")
    p.add_argument("--placement", default=None, choices=("linear", "interleaved", "v"),
                   help="placement of a rule (bf, bfw); order hints have their own")
    p.add_argument("--split-backward", action="store_true", help="separate B and W tasks")
    p.add_argument("--torch", default=None, metavar="SCHEDULE",
                   help="import torch.distributed.pipelining's schedule of this name instead "
                   "(e.g. Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)")
    p.set_defaults(func=run)


def describe(hint: HintOrder) -> list[str]:
    """Comment lines: per rank, the default cap and the activation memory it implies."""
    p = hint.placement
    kind = "rule (documented default cap)" if not hint.is_sequence else "order (cap = own peak)"
    lines = [f"# {hint.name}: {kind}; placement {p.style}, {p.num_chunks} chunk(s) per rank"]
    for rank, cap in enumerate(hint.default_caps or ()):
        worst = cap * p.num_chunks
        lines.append(
            f"# rank {rank}: default cap {cap} microbatches in flight -> at most {worst} chunk "
            f"activations (cap x {p.num_chunks} chunk(s)); the strict sequence holds "
            f"{hint.peak(rank)} microbatches / {hint.peak_chunk_activations(rank)} chunk "
            f"activations at its peak")
    return lines


def run(args: argparse.Namespace) -> int:
    if args.torch:
        from ..schedulers.from_torch import from_torch_schedule
        ranks = args.ranks or args.stages
        hint = from_torch_schedule(args.torch, ranks, args.microbatches,
                                   max(1, args.stages // ranks))
    else:
        hint = make_hint(args.hint, num_stages=args.stages, num_ranks=args.ranks,
                         num_microbatches=args.microbatches,
                         split_backward=args.split_backward, placement=args.placement)
    print(hint.dumps(), end="")
    if hint.sequence is not None:
        multi = hint.placement.num_chunks > 1
        print("# strict-mode sequence (derived):")
        for order in hint.sequence:
            print("#   " + " ".join(t.text(show_chunk=multi) for t in order))
    print("\n".join(describe(hint)))
    return 0
