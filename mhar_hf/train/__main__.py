"""`accelerate launch [--config_file training/configs/NAME.yaml] -m mhar_hf.train --model DIR --data PATH... --output OUT`"""

import sys

from .args import build_parser
from .loop import train


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        train(args)
    except (FileNotFoundError, ValueError, FileExistsError, NotADirectoryError) as error:
        print(f"mhar train: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
