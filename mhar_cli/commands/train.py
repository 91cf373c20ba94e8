"""`mhar train`: mid-training in this process (the same arguments as `accelerate launch -m mhar_hf.train`)."""

from __future__ import annotations


HELP = "mid-train a (converted) model; for several GPUs use accelerate launch -m mhar_hf.train"


def add_arguments(parser) -> None:
    from mhar_hf.train.options import add_arguments

    add_arguments(parser)


def parse(parser, argv):
    """The options, under them those of a `--config` file."""
    from mhar_hf.train.options import parse

    return parse(parser, argv)


def run(args) -> int:
    from mhar_hf.train.loop import train

    train(args)
    return 0
