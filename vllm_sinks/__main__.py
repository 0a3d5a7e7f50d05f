import sys

from vllm_sinks.cli import main

sys.exit(main())
