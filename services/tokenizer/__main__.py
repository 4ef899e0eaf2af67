"""`python -m pagoda.services.tokenizer [flags]`: run one tokenizer process."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from pagoda.shared.config import add_engine_args, add_server_args, engine_config_from_args, server_config_from_args
from pagoda.shared.errors import PagodaError

log = logging.getLogger("pagoda.services.tokenizer")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda.services.tokenizer",
                                     description="pagoda tokenizer process: text <-> token ids")
    add_engine_args(parser)
    add_server_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s tokenizer[%(process)d] %(name)s: %(message)s")
    # Imported after logging is set up: loading transformers takes a moment and may log. This process never
    # runs a model: with torch hidden, transformers loads tokenizers only instead of importing torch (which
    # was half of a restarted tokenizer's start: 20 s -> 7 s to a loaded tokenizer on a busy 2-core host).
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    from pagoda.services.tokenizer.service import run_tokenizer

    try:
        run_tokenizer(engine_config_from_args(args), server_config_from_args(args))
    except PagodaError as exc:  # a bad setting or a missing tokenizer: say so, no traceback
        log.error("%s", exc.message)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
