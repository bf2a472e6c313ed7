import sys

from orchestrator.entry import main

sys.exit(main())
