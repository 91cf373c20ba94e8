"""Convert a pretrained Llama-family checkpoint into an identity-preserving MHAR delta model.

    python conversion/convert_llama_to_mhar.py SRC DST [--heads 8] [--num-blocks 8]
        [--dtype keep|bfloat16|float32] [--max-shard-size 5GB] [--verify] [--overwrite]

The same as `mhar convert`; see `mhar_hf.convert.convert_checkpoint` for the Python API.
"""

import sys

from mhar_cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
