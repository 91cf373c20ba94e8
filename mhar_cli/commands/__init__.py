"""`mhar` subcommands, one module each: `HELP`, `add_arguments(parser)`, `run(args)`. Modules
import `mhar_hf` (torch, transformers) inside those functions, never at the top."""
