"""`python -m flows.bloom_imdb [--set KEY=VALUE] [--only STAGE] [--force STAGE]`: the bloom-imdb pipeline."""

import sys

from flows.finetune import main

if __name__ == "__main__":
    sys.exit(main("bloom-imdb"))
