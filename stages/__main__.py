import sys

from stages.cli import main_plain

sys.exit(main_plain())
