"""`python -m pagoda.services.tokenizer [flags]`: run one tokenizer process."""

from __future__ import annotations

from pagoda.services.tokenizer.service import run_tokenizer
from pagoda.shared.service_main import service_main

if __name__ == "__main__":
    service_main("tokenizer", run_tokenizer)
