"""`accelerate launch [--config_file training/configs/NAME.yaml] -m mhar_hf.train --model DIR --data PATH... --output OUT`"""

import sys

from .loop import train
from .options import build_parser, parse


def main(argv: list[str] | None = None) -> int:
    args = parse(build_parser(), sys.argv[1:] if argv is None else argv)
    try:
        train(args)
    except (FileNotFoundError, ValueError, FileExistsError, NotADirectoryError) as error:
        print(f"mhar train: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
