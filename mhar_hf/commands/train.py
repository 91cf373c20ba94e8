"""`mhar train`: mid-training in this process (the same arguments as `accelerate launch -m mhar_hf.train`)."""

from __future__ import annotations


def register(subparsers) -> None:
    from ..train.args import add_arguments

    parser = subparsers.add_parser("train", help="mid-train a (converted) model; for several GPUs use accelerate launch -m mhar_hf.train")
    add_arguments(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..train.loop import train

    train(args)
    return 0
