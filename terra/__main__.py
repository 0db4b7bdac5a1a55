"""`python -m terra train.py [args]` (see terra/launch.py)."""
import sys

from terra.launch import main

sys.exit(main())
