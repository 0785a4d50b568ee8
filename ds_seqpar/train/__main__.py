import sys

from .args import build_parser
from .preflight import check

# the options and the config first: a bad one is said before torch and DeepSpeed load
code = check(build_parser().parse_args(sys.argv[1:]))
if code is None:
    from .exits import exit_process
    from .main import main
    exit_process(main())
sys.exit(code)
